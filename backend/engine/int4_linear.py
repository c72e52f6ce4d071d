"""``weights_dtype=int4w``: the decoder layers' linear weights held as 4-bit groups (32 values
along the input dimension, each ``d * q + m`` with ``q`` in 0..15 and float16 ``d`` and ``m``:
the layout of a GGUF Q4_1 block), multiplied by our own kernel (``group_matmul.py``: the
activations as int16 per group, exact int32 sums per group, float32 beyond; the weights in tiles
of 16 rows, AVX-512 VNNI or AVX2, on the instance's threads) for products of up to
``group_linear.MAX_ROWS`` rows (a decode step of up to 16 sequences); products of more rows take
fp16w's (float16 weights through fbgemm where its limit is above the kernel's, float32 beyond:
prefill chunks). The LM head takes 8-bit groups (``int8_group_linear.py``) the same way.
``int4w-bf16``: the same, with fp16w-bf16's bfloat16 products on AMX tiles for the many-row ones.

What it reads per weight: half a byte plus an eighth of a byte of group constants (against
float16's two).

Quality: the groups are found from the float32 weights (``group_matmul.quantize_int4``); for a
checkpoint converted from a Q4_1 GGUF (the project's SmolLM2) every group is exact, so the
products are float32's up to the activations' int16 rounding and the order of the sums. For other
checkpoints the rounding is Q4_1's; the load logs how many layers are exact and the largest error.
torch's own int4 kernel (``_weight_int4pack_mm_for_cpu``) was measured and not used: it is
vectorized only for bfloat16 activations, scales and outputs (decode-step argmax agreement with
float32 98.2% on the held-out windows, below auto's 99%), and its float32 path is scalar (15x
slower).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from backend.engine.group_linear import GroupLinear
from backend.engine.group_matmul import GROUP, library, quantize_int4

log = logging.getLogger("triton_disagg.engine")


class Int4Linear(GroupLinear):
    """A linear layer whose products of at most ``group_linear.MAX_ROWS`` rows read its 4-bit
    groups (:class:`GroupLinear`) with 16-bit activations."""

    def __init__(self, linear: nn.Linear, max_rows: int, many_rows: torch.dtype = torch.float32, threads: int = 1):
        super().__init__(linear, max_rows, many_rows, quantize_int4(linear.weight), threads)


def quantize_linear_int4(
    model: nn.Module, max_rows: int, many_rows: torch.dtype = torch.float32, threads: int = 1
) -> nn.Module:
    """``weights_dtype=int4w``: every ``nn.Linear`` of the decoder layers (``model.model.layers``)
    replaced in place by :class:`Int4Linear` (the LM head: ``int8_group_linear.py``). Logs how many
    are exact 4-bit groups."""
    decoder_layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(decoder_layers, nn.Module):
        raise ValueError(f"int4w: {type(model).__name__} has no decoder layers (model.model.layers)")
    library()  # compile (or load) first: a missing compiler fails the load here, with the reason
    layers: list[Int4Linear] = []
    for module in list(decoder_layers.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % GROUP == 0:
                layers.append(Int4Linear(child, max_rows, many_rows, threads))
                setattr(module, name, layers[-1])
    exact = sum(1 for layer in layers if layer.group_error == 0.0)
    worst = max((layer.group_error for layer in layers), default=0.0)
    log.info(
        "int4w: %d linear layers in 4-bit groups of %d, %d exactly (largest error %.1e of a group's range); "
        "16-bit activations per group",
        len(layers),
        GROUP,
        exact,
        worst,
    )
    return model
