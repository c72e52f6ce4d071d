"""``weights_dtype=amx-bf16``: linear layers whose every product runs in bfloat16 on AMX tiles
through oneDNN; and the bfloat16 product that ``fp16w-bf16`` uses for its many-row products.

The weights are rounded to bfloat16 and packed once, at load, in oneDNN's blocked layout
(``mkldnn._reorder_linear_weight``); each product rounds its input to bfloat16, multiplies on AMX
tiles with float32 sums, and returns bfloat16 (torch's oneDNN linear returns its input's dtype),
widened to float32 before the bias and the residual add. The norms, the embedding, attention and
the KV pool stay in float32. Needs AMX-BF16 (``EngineConfig`` refuses the format without it,
naming the feature): oneDNN also has bfloat16 kernels for AVX512-BF16 and an emulation below
that, neither measured here.

Measured with SmolLM2-135M on an Intel Xeon with AMX, 2 threads (``perf/REPORT.md``): a decode
step at batch 1 46.9 tokens/s against fp16w's 32 and float32's 29, at batch 16 308 against 137
and 182; held-out perplexity 1.0007x float32's on the prompt and 0.998x on the decode steps, but
next-token argmax agreement with float32 96.9% on the decode steps (fp16w 100%, fp16w-bf16
99.6%): the rounding of every activation to 8 significant bits changes about one next token in
thirty where the top two are close. So ``auto`` does not pick it; it is the fastest format for
those who accept that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([out, in]) rounded to bfloat16 and packed for oneDNN's linear: an opaque tensor,
    deliberately kept out of buffers (``.to()`` or a state dict must not copy or move it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().bfloat16().contiguous(), None)


def bf16_product(packed: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ W.T + bias`` in bfloat16 on oneDNN (``packed`` from :func:`pack_bf16`), float32
    in and out, any leading shape; the bias added in float32."""
    onednn = torch.ops.mkldnn._linear_pointwise.default

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = onednn(x.bfloat16(), packed, None, "none", [], "").float()
        return out if bias is None else out + bias

    return forward


class Bf16Linear(nn.Module):
    """A linear layer whose products all run through :func:`bf16_product`. ``product()`` is its
    forward as a plain function (the lean layer loop calls it without the module call)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self._packed_weight = pack_bf16(linear.weight)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self._forward = self.product()

    def product(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return bf16_product(self._packed_weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=bfloat16 (oneDNN)"


def quantize_linear_bf16(model: nn.Module) -> nn.Module:
    """``weights_dtype=amx-bf16``: every ``nn.Linear`` of ``model`` (the LM head and fused
    projections included) replaced in place by :class:`Bf16Linear`."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Bf16Linear(child))
    return model
