"""Verification of draft tokens against the target model's logits (one row per chunk position).

Row ``i`` of ``logits`` is the target's distribution for the token after chunk position ``i``
(position 0 is the sequence's last token, positions 1..k the drafts). Greedy: accept drafts while
each equals the argmax, then append the argmax at the first mismatch (or after the last draft).
Sampling: the standard speculative-sampling rule for a deterministic drafter (point-mass
proposal): accept ``d_i`` with probability ``p_i(d_i)``; on rejection sample from ``p_i`` with
``d_i`` removed and renormalised; after all are accepted sample the bonus token from ``p_k``.
Either way the output is distributed exactly as plain decoding's.
"""

from __future__ import annotations

import torch

from backend.engine.sampling.sampler import token_probs
from backend.engine.sampling_params import SamplingParams


def verify(
    logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator | None
) -> list[int]:
    """Tokens to append: the accepted prefix of ``drafts`` plus one token from the target."""
    if params.greedy:
        target = logits[: len(drafts) + 1].argmax(dim=-1).tolist()
        out = []
        for draft, best in zip(drafts, target):
            if draft != best:
                break
            out.append(draft)
        out.append(target[len(out)])
        return out
    out = []
    for i, draft in enumerate(drafts):
        probs = token_probs(logits[i].float(), params)
        if torch.rand((), generator=generator, device=probs.device) < probs[draft]:
            out.append(draft)
            continue
        residual = probs.clone()
        residual[draft] = 0.0  # p(draft) < 1 here, so the residual has mass
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)[0]))
        return out
    probs = token_probs(logits[len(drafts)].float(), params)
    out.append(int(torch.multinomial(probs, 1, generator=generator)[0]))
    return out
