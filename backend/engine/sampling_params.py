"""Per-request sampling parameters, validated once where they are built."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

DRAFT_METHODS = ("lookup", "hidden")
MAX_DRAFT_TOKENS = 16
MAX_TOP_LOGPROBS = 20
MAX_CACHE_SALT = 256


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    ``stop_token_ids``: token sequences that end the request when the output ends with one of them
    (string stop words are tokenized by the caller). ``end_ids`` end the request unless
    ``ignore_eos``; before ``min_tokens`` output tokens they are never sampled (their logits are
    masked) and never end it. ``seed`` makes random sampling reproducible. ``temperature == 0`` is greedy.
    ``num_draft_tokens`` > 0 turns on speculative decoding with up to that many draft tokens per
    step, proposed by ``draft_method`` (see ``backend/engine/sampling/drafters.py``). ``grammar``: a compiled
    grammar (``backend/engine/sampling/grammar.py``) constraining the output, or None;
    ``grammar_prefix``: output tokens generated before (a migrated request continues after them)
    that the grammar replays first. ``logprobs``: None, or each output token's log-probability
    plus the ``logprobs`` most likely tokens at its position; ``prompt_logprobs``: the same for the
    prompt's tokens 2..P (a request asking for them computes its whole prompt: no cached prefix,
    no KV from elsewhere). Neither combines with draft tokens. ``cache_salt``: the request's
    prefix-cache tenant: its KV pages match only requests with the same salt (empty: shared by all).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    end_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    num_draft_tokens: int = 0
    draft_method: str = "lookup"
    grammar: CompiledGrammar | None = None
    grammar_prefix: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.end_ids, int):
            self.end_ids = (self.end_ids,)
        self.end_ids = tuple(int(t) for t in self.end_ids)
        self.stop_token_ids = tuple(tuple(int(t) for t in seq) for seq in self.stop_token_ids)
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT:
            raise ValueError(f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (0 <= int(self.seed) < 2**64):
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if any(len(seq) == 0 for seq in self.stop_token_ids):
            raise ValueError("stop_token_ids must not contain an empty sequence")
        if not isinstance(self.num_draft_tokens, int) or not 0 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {self.num_draft_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS):
                raise ValueError(f"{name} must be None or in [0, {MAX_TOP_LOGPROBS}], got {k!r}")
        if self.num_draft_tokens and (self.logprobs is not None or self.prompt_logprobs is not None):
            raise ValueError("log-probabilities cannot be combined with speculative decoding (num_draft_tokens > 0)")
        if self.draft_method not in DRAFT_METHODS:
            raise ValueError(f"draft_method must be one of {DRAFT_METHODS}, got {self.draft_method!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
