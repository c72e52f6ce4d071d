"""The sampler: greedy, or temperature / top-k / top-p with per-request seeded generators."""

from __future__ import annotations

import torch

from backend.engine.sampling_params import SamplingParams


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


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row of ``logits`` [num_seqs, vocab]."""
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        tokens = tokens.clone()
        for row in random_rows:
            tokens[row] = _sample_row(logits[row].float(), params[row], generators[row])
    return tokens.tolist()


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
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
