"""``weights_dtype=fp16w``: linear layers whose weights are held in float16 and multiplied through
fbgemm's fp16-weight GEMM (CPU), with float32 activations and float32 sums.

The weights are rounded to float16 once, at load, and packed in fbgemm's layout
(``fbgemm_pack_gemm_matrix_fp16``); each product converts them back to float32 in registers
(F16C) and multiplies in float32 (AVX2 or AVX-512 FMA): half the bytes read per product, which
is what a decode step's few-row products wait for, and no rounding but the weights' own. The
inputs, the outputs, the norms, the embedding, attention and the KV pool stay in float32. A
row's result depends on that row only. Needs AVX2 and F16C (``EngineConfig`` refuses the format
on a CPU without them, naming the feature); every one of fbgemm's kernels (AVX2, AVX-512)
computes the same thing, float16 weights and float32 sums, so the quality does not depend on the
CPU (unlike int8's activation range; the last bits may, as float32's do). torch marks both ops
deprecated (it prints so once per process) but keeps them in its CPU build.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class Fp16Linear(nn.Module):
    """A linear layer with float16 weights and float32 activations and sums (see the module's
    docstring). ``product()`` is its forward as a plain function (the lean layer loop calls it
    without the module call)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            # an opaque handle to fbgemm's packed matrix (a byte tensor that owns it), deliberately
            # not a buffer: .to() or a state dict must not copy or move it
            self._packed_weight = torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(
                linear.weight.detach().float().contiguous()
            )
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self._forward = self.product()

    def product(self) -> Callable[[torch.Tensor], torch.Tensor]:
        op, packed, bias = (
            torch.ops.aten.fbgemm_linear_fp16_weight_fp32_activation.default,
            self._packed_weight,
            self.bias,
        )

        def forward(x: torch.Tensor) -> torch.Tensor:
            return op(x, packed, bias)

        return forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=float16"


def quantize_linear_fp16(model: nn.Module) -> nn.Module:
    """``weights_dtype=fp16w``: every ``nn.Linear`` of ``model`` (the LM head and fused projections
    included) replaced in place by :class:`Fp16Linear`; the residual stream is left as it is."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Fp16Linear(child))
    return model
