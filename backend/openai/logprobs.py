"""Log-probabilities in OpenAI's shapes, from the token ids and log-probabilities Triton sends
(:class:`Delta`): a completion's legacy object (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``; with ``echo`` the prompt's tokens first, the very first with no log-probability)
and a chat's ``content`` entries (``token``, ``logprob``, ``bytes``, ``top_logprobs``).

A token's text is the tokenizer's decoding of that one id; its bytes the token's own bytes (a
byte-level token that is part of a UTF-8 character decodes to U+FFFD, but its bytes are exact).
A completion's ``top_logprobs`` at a position maps token text to log-probability for the k most
likely tokens and the chosen one (OpenAI: up to k + 1 entries); two ids with the same text keep
the likelier one's value. So a greedy token's log-probability is the largest value of its map
(lm-eval's check), and ``logprobs`` 0 gives the chosen token alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

from backend.openai.triton_stream import Delta, TopTokens

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece's byte fallback


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: character -> the byte it stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class TokenTexts:
    """The text and bytes of single tokens of ``tokenizer`` (a transformers tokenizer), cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._text:
            self._text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self._text[token_id]

    def bytes_of(self, token_id: int) -> list[int]:
        if token_id not in self._bytes:
            text = self.text(token_id)
            raw = self._raw_bytes(token_id) if "\ufffd" in text else None
            self._bytes[token_id] = list(raw if raw is not None else text.encode("utf-8"))
        return self._bytes[token_id]

    def _raw_bytes(self, token_id: int) -> bytes | None:
        """The bytes of a token that decodes to part of a character, when its piece says them."""
        try:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
        except Exception:  # a tokenizer without pieces: the text's bytes then
            return None
        if not isinstance(piece, str):
            return None
        m = _BYTE_TOKEN.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        alphabet = _byte_level_alphabet()
        if piece and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return None


def _check(what: str, ids: Sequence[int], lps: Sequence[float] | None, tops: Sequence[TopTokens] | None) -> None:
    if lps is None or len(lps) != len(ids):
        raise ValueError(f"{what}: {len(ids)} token(s) but {'no' if lps is None else len(lps)} log-probabilities")
    if tops is not None and len(tops) != len(ids):
        raise ValueError(f"{what}: {len(ids)} token(s) but top tokens for {len(tops)}")


class CompletionLogprobs:
    """A completion's legacy ``logprobs`` objects, one per piece of the answer (a streamed chunk,
    or the whole answer: :meth:`join`); ``text_offset`` counts characters of the answer's text
    from its start (with echo the prompt's text is its start)."""

    def __init__(self, texts: TokenTexts):
        self.texts = texts
        self.offset = 0  # characters of the answer's text before the next piece

    def _top(self, chosen: int, lp: float, top: TopTokens | None) -> dict[str, float]:
        out: dict[str, float] = {}
        for tid, value in top or ():
            out.setdefault(self.texts.text(tid), value)
        out.setdefault(self.texts.text(chosen), lp)
        return out

    def _tops(self, ids: Sequence[int], lps: Sequence[float], tops: Sequence[TopTokens] | None) -> list:
        return [self._top(t, lp, tops[i] if tops is not None else None) for i, (t, lp) in enumerate(zip(ids, lps))]

    def prompt(self, delta: Delta, text: str) -> dict:
        """The prompt's tokens (echo), from the first response; ``text``: the prompt's text as
        echoed."""
        ids = delta.prompt_token_ids or []
        if not ids:
            raise ValueError("Triton sent no prompt_token_ids for a request that asked for them")
        lps, tops = delta.prompt_log_probs, delta.prompt_top_log_probs
        _check("prompt", ids[1:], lps, tops)
        assert lps is not None
        return self._piece(ids, [None, *lps], [None, *self._tops(ids[1:], lps, tops)], len(text))

    def output(self, delta: Delta) -> dict:
        """The tokens of one response (``delta.text`` is their text)."""
        ids, lps, tops = delta.token_ids, delta.log_probs, delta.top_log_probs
        if not ids:
            return self._piece([], [], [], len(delta.text))
        _check("output", ids, lps, tops)
        assert lps is not None
        return self._piece(ids, list(lps), self._tops(ids, lps, tops), len(delta.text))

    def _piece(self, ids: Sequence[int], lps: list, tops: list, text_len: int) -> dict:
        tokens = [self.texts.text(t) for t in ids]
        offsets, at = [], self.offset
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        self.offset += text_len  # the answer's own text decides where the next piece starts
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def join(pieces: Sequence[dict]) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for piece in pieces:
            for key, values in out.items():
                values.extend(piece[key])
        return out


def chat_content(texts: TokenTexts, delta: Delta, k: int) -> list[dict]:
    """A chat's ``logprobs.content`` entries for the tokens of one response (k top tokens each)."""
    ids, lps, tops = delta.token_ids, delta.log_probs, delta.top_log_probs
    if not ids:
        return []
    _check("output", ids, lps, tops)
    assert lps is not None
    out = []
    for i, (tid, lp) in enumerate(zip(ids, lps, strict=True)):
        top = tops[i][:k] if tops is not None and k else []
        out.append(
            {
                "token": texts.text(tid),
                "logprob": lp,
                "bytes": texts.bytes_of(tid),
                "top_logprobs": [{"token": texts.text(t), "logprob": v, "bytes": texts.bytes_of(t)} for t, v in top],
            }
        )
    return out
