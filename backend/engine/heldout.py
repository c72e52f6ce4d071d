"""Held-out quality of a weight format, the measure behind ``auto``'s quality gate
(``QUALITY_LIMIT`` in ``backend/engine/config.py``): windows of held-out text (``WINDOW`` prompt
tokens, then ``WINDOW_DECODE`` decode steps), and from a format's next-token negative
log-likelihoods and argmax tokens at every scored position, its perplexity, the ratio to a
reference's and the argmax agreement with it, for the prompt positions and the decode steps apart.
``triton-disagg bench formats`` and the quality tests (``tests/integration/test_*_quality.py``)
measure with it."""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW, WINDOW_DECODE = 512, 32


def heldout_windows(tokenizer, path: Path, count: int) -> list[list[int]]:
    """Up to ``count`` windows of WINDOW + WINDOW_DECODE tokens of the text, starting every WINDOW."""
    ids = tokenizer.encode(Path(path).read_text(), add_special_tokens=False)
    size = WINDOW + WINDOW_DECODE
    return [ids[s : s + size] for s in range(0, len(ids) - size + 1, WINDOW)][:count]


def heldout_figures(nll: torch.Tensor, top: torch.Tensor, reference: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Perplexity, its ratio to the reference's and the argmax agreement with it, for the prompt
    positions (the chunked prefill) and the decode steps apart."""
    out = {}
    for part, cols in (("prefill", slice(0, WINDOW - 1)), ("decode", slice(WINDOW - 1, None))):
        mean, ref_mean = nll[:, cols].mean(), reference[0][:, cols].mean()
        out[f"heldout_ppl_{part}"] = float(mean.exp())
        out[f"heldout_ppl_ratio_{part}"] = float((mean - ref_mean).exp())
        out[f"heldout_argmax_agree_{part}"] = float((top[:, cols] == reference[1][:, cols]).float().mean())
    return out
