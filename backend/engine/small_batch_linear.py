"""Linear layers for the few-row products of decode steps on the CPU (float32 weights).

A decode step multiplies a handful of rows (one per running sequence) by each weight matrix, and
its time is reading the weights. ``F.linear(x, W)`` sends one row to MKL's matrix-vector kernel
and a few to its matrix-matrix one, which read SmolLM2-135M's float32 weights (its 121 decode-step
products, 540 MB) at about 10 GB/s on 2 threads. Up to ``MAX_ROWS`` rows these layers take our
kernel library's float32 product instead (``group_matmul.f32_product``: each weight read once per
8 rows, in order, split between the instance's threads), which reads them at the memory's speed.
Measured on an AMD EPYC family 25 model 17 (Zen 4), 2 threads, those 121 products: 1 row 24 ms
(22 GB/s; MKL 50), 4 rows 31 (41), 8 rows 38 (62), 16 rows 59 (76). Same products summed in
another order: outputs may differ from ``F.linear``'s in the last bits (greedy tokens are unchanged
in the engine's tests against transformers). Where the library cannot be built (no C compiler) the
layers are plain ``nn.Linear``.
"""

from __future__ import annotations

import torch

from backend.engine.group_matmul import FLOAT_ROWS, f32_product, f32_unsupported

MAX_ROWS = FLOAT_ROWS


class SmallBatchLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose float32 products of at most ``MAX_ROWS`` rows take our kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        rows = x.numel() // k
        weight = self.weight
        if rows > MAX_ROWS or x.dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_contiguous():
            return super().forward(x)
        out = f32_product(weight, x.reshape(rows, k).contiguous(), torch.get_num_threads())
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], weight.shape[0])


def use_small_batch_linears(model: torch.nn.Module) -> int:
    """Turn the model's ``nn.Linear`` layers (CPU, float32 weights, inputs a multiple of 16) into
    :class:`SmallBatchLinear` in place; returns how many (0 where the kernel library cannot run)."""
    if f32_unsupported() is not None:
        return 0
    n = 0
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if type(m) is torch.nn.Linear and weight is not None and weight.device.type == "cpu":
            if weight.dtype == torch.float32 and m.in_features % 16 == 0:
                m.__class__ = SmallBatchLinear
                n += 1
    return n
