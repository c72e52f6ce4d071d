"""Structured output with xgrammar: compile a request's JSON schema or regex once at admission,
then keep a per-request matcher that yields token bitmasks for the sampler.

Decode side only (aggregated engine or decode role). With speculative decoding the matcher
first walks the draft tokens to cut them at the first one the grammar rejects and to fill one
bitmask row per chunk position, then rolls back; after verification it advances by the tokens
actually emitted, so it always matches the sequence's output.
"""

from __future__ import annotations

import re
import threading

import torch
import xgrammar as xgr


class GrammarError(ValueError):
    """The schema or regex cannot be compiled; the message is meant for the client."""


class GrammarCompiler:
    """Compiles grammars for one tokenizer (thread-safe; one compile at a time). xgrammar keeps
    compiled grammars in a cache of at most ``cache_limit_bytes`` (-1: unbounded)."""

    def __init__(self, tokenizer, vocab_size: int, cache_limit_bytes: int = -1):
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_limit_bytes=cache_limit_bytes)
        self._lock = threading.Lock()

    def compile(self, json_schema: str | None = None, regex: str | None = None) -> "xgr.CompiledGrammar":
        if (json_schema is None) == (regex is None):
            raise GrammarError("give exactly one of 'guided_json' and 'guided_regex'")
        try:
            with self._lock:
                if json_schema is not None:
                    return self._compiler.compile_json_schema(json_schema, any_whitespace=False)
                assert regex is not None  # exactly one of them was given
                return self._compiler.compile_regex(regex)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the parser's message
            kind = "guided_json schema" if json_schema is not None else "guided_regex"
            raise GrammarError(f"invalid {kind}: {_first_line(exc)}") from None


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, compiled: "xgr.CompiledGrammar"):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size

    def check_drafts(self, drafts: list[int]) -> tuple[list[int], torch.Tensor]:
        """(the drafts up to the first one the grammar rejects or that completes it, bitmask with
        one row per chunk position: the current state, then after each kept draft)."""
        bitmask = xgr.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        kept = 0
        for draft in drafts:
            if not self.matcher.accept_token(draft):
                break
            kept += 1
            if self.matcher.is_terminated():  # nothing may follow: drop the completing draft
                kept -= 1
                self.matcher.rollback(1)
                break
            self.matcher.fill_next_token_bitmask(bitmask, kept)
        if kept:
            self.matcher.rollback(kept)
        return drafts[:kept], bitmask[: kept + 1]

    def mask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """A masked copy of ``logits`` [rows, vocab] (disallowed tokens at -inf)."""
        out = logits.float().clone()
        xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), vocab_size=self.vocab_size)
        return out

    def advance(self, tokens: list[int]) -> None:
        for token in tokens:
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"token {token} violates the grammar after masking")

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()


_NOISE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def _first_line(exc: Exception) -> str:
    """xgrammar's message without its timestamp, source location and assertion text."""
    for line in str(exc).splitlines():
        if line.strip():
            return _NOISE.sub("", line.strip())[:300]
    return type(exc).__name__
