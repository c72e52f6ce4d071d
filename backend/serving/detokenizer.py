"""Incremental detokenization with stop strings, for streaming text deltas to clients."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; holds back a possible partial
    UTF-8 character and any text that may be the start of a stop string."""

    def __init__(self, tokenizer, stop_words: list[str] | None = None):
        self.tok = tokenizer
        self.stop_words = list(stop_words or [])
        self.ids: list[int] = []
        self.sent = 0  # characters already returned
        self.stopped = False

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the new text that is safe to send."""
        self.ids.extend(new_ids)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        end = len(text)
        for w in self.stop_words:
            i = text.find(w)
            if i != -1 and i < end:
                end, self.stopped = i, True
        if not self.stopped and not final:
            if text.endswith("\ufffd"):
                end = len(text) - 1
            hold = max((k for w in self.stop_words for k in range(1, len(w)) if text.endswith(w[:k])), default=0)
            end = min(end, len(text) - hold)
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta
