"""int4w's LM head: its weights held as 8-bit groups of 32 along the input dimension (each value
``d * q``, ``q`` in -127..127, float16 ``d``: GGUF Q8_0's block, which a checkpoint converted from
a GGUF with a Q8_0 token embedding, the project's SmolLM2, holds exactly), multiplied by our own
kernel (``group_matmul.py``) for products of up to ``group_linear.MAX_ROWS`` rows, by fp16w's beyond.

The LM head is the largest single product of a small model's decode step (SmolLM2-135M: 28 M of its
135 M weights): float16's two bytes per weight were 57 MB read per step, 8-bit groups' 1.0625 are 30.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from backend.engine.group_linear import GroupLinear
from backend.engine.group_matmul import GROUP, library, quantize_int8

log = logging.getLogger("triton_disagg.engine")


class Int8GroupLinear(GroupLinear):
    """A linear layer whose products of at most ``group_linear.MAX_ROWS`` rows read its 8-bit
    groups (:class:`GroupLinear`)."""

    def __init__(self, linear: nn.Linear, max_rows: int, many_rows: torch.dtype = torch.float32, threads: int = 1):
        super().__init__(linear, max_rows, many_rows, quantize_int8(linear.weight), threads)


def quantize_lm_head_int8(
    model: nn.Module, max_rows: int, many_rows: torch.dtype = torch.float32, threads: int = 1
) -> nn.Module:
    """The model's ``lm_head`` replaced in place by :class:`Int8GroupLinear` (left as it is when its
    input is not in groups of 32); logs whether its groups are exact."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or head.in_features % GROUP:
        log.info("int4w: the LM head stays float16 (not a linear layer over groups of %d)", GROUP)
        return model
    library()
    model.lm_head = Int8GroupLinear(head, max_rows, many_rows, threads)
    log.info(
        "int4w: the LM head in 8-bit groups of %d (%s)",
        GROUP,
        "exactly" if model.lm_head.group_error == 0.0 else f"largest error {model.lm_head.group_error:.1e} of a group",
    )
    return model
