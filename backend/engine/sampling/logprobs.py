"""Log-probabilities of chosen tokens and the top-k alternatives at their positions, from logits."""

from __future__ import annotations

import torch

from backend.engine.outputs import TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> TokenLogprobs:
    """``logits`` [n, vocab]: row i is the distribution token ``token_ids[i]`` was drawn from."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=lp.device)[:, None]
    chosen = lp.gather(1, ids)[:, 0]
    if k:
        top = lp.topk(k, dim=-1)
        top_lp, top_ids = top.values, top.indices
    else:
        top_lp, top_ids = lp.new_zeros((lp.shape[0], 0)), torch.zeros((lp.shape[0], 0), dtype=torch.long)
    return TokenLogprobs(chosen.cpu(), top_ids.cpu(), top_lp.cpu())
