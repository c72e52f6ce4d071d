"""Incremental detokenization with stop strings, for streaming text deltas to clients."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; holds back a possible partial
    UTF-8 character and any text that may be the start of a stop string.

    Each call decodes only the tokens since the last complete text and the batch before them
    (their context: a tokenizer that drops a leading space, a character spread over several
    tokens), not the whole output: a token costs the same at the 2,000th as at the first. The
    text is the difference of two decodes that start at the same token, so it is the text a
    decode of the whole output gives for byte-level BPE (SmolLM2, Llama 3) and SentencePiece
    tokenizers. Stop strings are looked for in the new text and the few characters before it."""

    def __init__(self, tokenizer, stop_words: list[str] | None = None):
        self.tok = tokenizer
        self.stop_words = [w for w in stop_words or [] if w]
        self.ids: list[int] = []
        self.text = ""  # the text of ids[:_read], complete characters only
        self._prefix = 0  # ids[_prefix:_read] decode to the end of ``text``: the next decode's context
        self._read = 0
        self._before: str | None = None  # the decode of ids[_prefix:_read], once needed
        self._searched = 0  # text[:_searched] holds no stop string
        self.sent = 0  # characters already returned
        self.stopped = False

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the new text that is safe to send."""
        self.ids.extend(new_ids)
        if self.stopped:
            return ""
        text = self._decode_new(final)
        end = len(text)
        if self.stop_words:
            longest = max(len(w) for w in self.stop_words)
            start = max(0, self._searched - longest + 1)
            for w in self.stop_words:
                i = text.find(w, start)
                if i != -1 and i < end:
                    end, self.stopped = i, True
            self._searched = len(text)
        if not self.stopped and not final:
            hold = max((k for w in self.stop_words for k in range(1, len(w)) if text.endswith(w[:k])), default=0)
            end = len(text) - hold
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def _decode_new(self, final: bool) -> str:
        """The text so far. The tokens past ``_read`` join ``text`` once they end in a complete
        character (at the end of the output: whatever they make, as a whole decode would); until
        then the complete characters before their last one are shown, not kept."""
        if len(self.ids) == self._read:
            return self.text
        decode = self.tok.decode
        if self._before is None:
            self._before = decode(self.ids[self._prefix : self._read], skip_special_tokens=True) if self._read else ""
        new = decode(self.ids[self._prefix :], skip_special_tokens=True)[len(self._before) :]
        if not new:  # special tokens only: keep the context (a leading-space rule needs a piece)
            return self.text
        if final or not new.endswith("\ufffd"):
            self.text += new
            self._prefix, self._read, self._before = self._read, len(self.ids), None
            return self.text
        return self.text + new.rstrip("\ufffd")
