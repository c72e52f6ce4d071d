"""Sampling parameters and the sampler (greedy, or temperature / top-k / top-p with per-request seeds)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

DRAFT_METHODS = ("lookup", "hidden")
MAX_DRAFT_TOKENS = 16


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    ``stop_token_ids``: token sequences that end the request when the output ends with one of them
    (string stop words are tokenized by the caller). ``end_ids`` end the request unless
    ``ignore_eos``. ``seed`` makes random sampling reproducible. ``temperature == 0`` is greedy.
    ``num_draft_tokens`` > 0 turns on speculative decoding with up to that many draft tokens per
    step, proposed by ``draft_method`` (see ``backend/drafters.py``). ``grammar``: a compiled
    grammar (``backend/structured_output.py``) constraining the output, or None.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    end_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    ignore_eos: bool = False
    num_draft_tokens: int = 0
    draft_method: str = "lookup"
    grammar: object | None = None

    def __post_init__(self) -> None:
        if isinstance(self.end_ids, int):
            self.end_ids = (self.end_ids,)
        self.end_ids = tuple(int(t) for t in self.end_ids)
        self.stop_token_ids = tuple(tuple(int(t) for t in seq) for seq in self.stop_token_ids)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (0 <= int(self.seed) < 2**64):
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed!r}")
        if any(len(seq) == 0 for seq in self.stop_token_ids):
            raise ValueError("stop_token_ids must not contain an empty sequence")
        if not isinstance(self.num_draft_tokens, int) or not 0 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {self.num_draft_tokens!r}")
        if self.draft_method not in DRAFT_METHODS:
            raise ValueError(f"draft_method must be one of {DRAFT_METHODS}, got {self.draft_method!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator seeded by ``params.seed`` (random seed when None); None for greedy requests."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(params.seed))
    return generator


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row of ``logits`` [num_seqs, vocab]."""
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        tokens = tokens.clone()
        for row in random_rows:
            tokens[row] = _sample_row(logits[row].float(), params[row], generators[row])
    return tokens.tolist()


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(token_probs(logits, params), 1, generator=generator)[0]


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution random sampling draws from: temperature, then top-k, then top-p."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_logits.softmax(dim=-1) >= params.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    return logits.softmax(dim=-1)
