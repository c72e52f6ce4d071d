"""The bfloat16 product (oneDNN: on AMX tiles, or with AVX512-BF16's pair dot products) that
``weights_dtype=fp16w-bf16`` and ``int4w-bf16`` use for their many-row products (prefill chunks).

The weights are rounded to bfloat16 and packed once, at load, in oneDNN's blocked layout
(``mkldnn._reorder_linear_weight``); each product rounds its input to bfloat16, multiplies on AMX
tiles (or AVX512-BF16) with float32 sums, and returns bfloat16 (torch's oneDNN linear returns its
input's dtype), widened to float32 before the bias and the residual add. Needs AMX-BF16 or
AVX512-BF16 (``EngineConfig`` refuses the format with neither, naming them; oneDNN's emulation
below that is not measured). With AVX512-BF16 alone (an AMD EPYC, family 25 model 17, 2 threads):
a 512-token prefill of SmolLM2-135M 1.6x float32's; quality as on AMX tiles
(``tests/integration/test_fp16w_quality.py``).

Tried and not adopted: every product in bfloat16, decode steps included. In the engine alone (an
Intel Xeon with AMX, 2 threads) a decode step at batch 1 ran 45.2 tokens/s against fp16w's 32.6,
at batch 16 315 against 135; but through the server one stream ran 24.5 tokens/s against 34.3
for fp16w-bf16 (oneDNN's two OpenMP threads wait for each other whenever Triton or the client
takes a core, as the compiled kernels of issue 37 did), eight streams' ITL p50 59.7 ms against
62.2, and its decode-step argmax agreement with float32 was 96.9% (``perf/REPORT.md``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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
