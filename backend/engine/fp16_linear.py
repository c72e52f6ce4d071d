"""``weights_dtype=fp16w`` and ``fp16w-bf16``: linear layers whose weights are held in float16
and multiplied with float32 activations and float32 sums for the few-row products of decode steps;
products of more rows (prefill chunks, large batches) take float32 weights (``fp16w``) or bfloat16
weights and activations on AMX tiles or AVX512-BF16 (``fp16w-bf16``).

The weights are rounded to float16 once, at load; each product converts them back to float32 in
registers (F16C) and multiplies in float32 (AVX2 or AVX-512 FMA): half the bytes read per
product, which is what a decode step's few-row products wait for, and no rounding but the
weights' own. The inputs, the outputs, the norms, the embedding, attention and the KV pool stay in
float32. Products of up to ``FLOAT_ROWS`` rows take our kernel library's float16 product
(``group_matmul.f32_product`` over the float16 weights as torch holds them: each weight read once
per 8 rows, split between the instance's ``threads``), and the fused decode step takes them too
(``fused_decode.py``); fbgemm's fp16-weight GEMM (one thread, its own packed copy) takes products
of more rows up to :func:`fp16_max_rows` (only on one thread, where that limit is 64), and layers
whose inputs are not a multiple of 16 (our kernel's unit). Needs AVX2 and F16C (``EngineConfig``
refuses the format on a CPU without them, naming the feature); every kernel (AVX2, AVX-512)
computes the same thing, float16 weights and float32 sums, so the quality does not depend on the
CPU (the last bits may, as float32's do).

fbgemm's fp16 GEMM computes rather than waits for memory once a product has more than a few rows:
measured on an Intel Xeon (AVX-512) with SmolLM2-135M's shapes, it is faster than float32 up to
about 64 rows on 1 thread and 16 on 2 threads, and 2.2x slower than float32 at 256 rows on 2
threads (``perf/REPORT.md``). So each layer also keeps its float32 weights (1.5x float32's weight
memory in all) and a product of more than :func:`fp16_max_rows` rows multiplies by them, exactly
as ``float32`` does: prefill chunks compute what float32 computes, decode steps read float16. A
row's result depends on how many rows share its product (which kernel takes it), never on the
other rows' values.

``fp16w-bf16`` multiplies those many-row products in bfloat16 instead (``bf16_linear.py``'s
product: oneDNN's bfloat16 kernel, AMX tiles or AVX512-BF16, over weights packed once at load,
the input rounded to bfloat16, float32 sums, the output rounded to bfloat16 and widened back to
float32 before the residual add).
Measured with SmolLM2-135M's shapes on an Intel Xeon with AMX, 2 threads: 512 rows through all 121
products 81 ms against float32's 280 (3.5x), a product's relative error 2.9e-3 (float32's 3.5e-7);
held-out perplexity 1.0007x float32's on the prompt, 0.9995x on the decode steps that follow it,
which keep the float16 weights (``perf/REPORT.md``). It keeps bfloat16 weights instead of
float32 ones: 1.0x float32's weight memory in all, against fp16w's 1.5x.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from backend.engine.bf16_linear import bf16_product, pack_bf16
from backend.engine.formats import weight_format
from backend.engine.group_matmul import FLOAT_ROWS, f32_product, f32_unsupported


def fp16_max_rows(threads: int) -> int:
    """The most rows a product takes through the float16 weights with ``threads`` torch threads:
    64 on 1 thread and 16 on 2 (measured crossovers, module docstring), and 64 / threads^2 beyond,
    where float32's multi-threaded GEMM pulls further ahead of fbgemm's single thread."""
    return max(1, 64 // max(1, threads) ** 2)


class Fp16Linear(nn.Module):
    """A linear layer with float16 weights and float32 activations and sums for products of at
    most ``max_rows`` rows, and its ``many_rows`` weights (float32, or bfloat16 through oneDNN) for
    larger ones (see the module's docstring). ``product()`` is its forward as a plain function (the
    lean layer loop calls it without the module call). ``max_rows``: default :func:`fp16_max_rows`
    of torch's thread count at load. ``threads``: how many threads our float16 product splits a
    product between; ``ours=False`` keeps it from taking any (int4w's layers, whose group kernel
    takes the few rows). ``half_weight``: the float16 weights our product reads (None where it takes none)."""

    def __init__(
        self,
        linear: nn.Linear,
        max_rows: int | None = None,
        many_rows: torch.dtype = torch.float32,
        threads: int = 1,
        ours: bool = True,
    ):
        super().__init__()
        if many_rows not in (torch.float32, torch.bfloat16):
            raise ValueError(f"Fp16Linear: many_rows must be float32 or bfloat16, got {many_rows}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.max_rows = fp16_max_rows(torch.get_num_threads()) if max_rows is None else max_rows
        self.many_rows, self.threads = many_rows, threads
        ours = ours and bool(self.max_rows) and self.in_features % 16 == 0 and f32_unsupported() is None
        with torch.no_grad():
            weight = linear.weight.detach().float().contiguous()
            self.half_weight = weight.half().contiguous() if ours else None
            # opaque handles to fbgemm's and oneDNN's packed matrices (tensors that own them),
            # deliberately not buffers: .to() or a state dict must not copy or move them;
            # fbgemm's only where it takes some products (more rows than ours, up to max_rows)
            fbgemm = self.max_rows > (FLOAT_ROWS if ours else 0)
            self._packed_weight = torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(weight) if fbgemm else None
            self._packed_bf16 = pack_bf16(weight) if many_rows == torch.bfloat16 else None
        self.weight = nn.Parameter(weight, requires_grad=False) if many_rows == torch.float32 else None
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self._forward = self.product()

    def product(self) -> Callable[[torch.Tensor], torch.Tensor]:
        op, packed, bias, max_rows = (
            torch.ops.aten.fbgemm_linear_fp16_weight_fp32_activation.default,
            self._packed_weight,
            self.bias,
            self.max_rows,
        )
        many: Callable[[torch.Tensor], torch.Tensor]
        if self._packed_bf16 is None:
            weight = self.weight
            assert weight is not None

            def float32_product(x: torch.Tensor) -> torch.Tensor:
                return F.linear(x, weight, bias)

            many = float32_product

        else:
            many = bf16_product(self._packed_bf16, bias)
        half, threads, n = self.half_weight, self.threads, self.out_features

        def forward(x: torch.Tensor) -> torch.Tensor:
            k = x.shape[-1]
            rows = x.numel() // k
            if half is not None and rows <= FLOAT_ROWS:
                out = f32_product(half, x.reshape(rows, k).contiguous(), threads)
                if bias is not None:
                    out += bias
                return out.reshape(*x.shape[:-1], n)
            if packed is not None and rows <= max_rows:
                return op(x, packed, bias)
            return many(x)

        return forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weights=float16 up to {self.max_rows} rows, {str(self.many_rows).removeprefix('torch.')} beyond"
        )


def quantize_linear_fp16(
    model: nn.Module, max_rows: int | None = None, weights: str = "fp16w", threads: int = 1
) -> nn.Module:
    """``weights_dtype=fp16w`` or ``fp16w-bf16`` (``weights``): every ``nn.Linear`` of ``model``
    (the LM head and fused projections included) replaced in place by :class:`Fp16Linear` (our
    float16 product on ``threads`` threads, the format's many-row products beyond its limit); the
    residual stream is left as it is."""
    many_rows = many_rows_dtype(weights)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Fp16Linear(child, max_rows, many_rows, threads))
    return model


def many_rows_dtype(weights: str) -> torch.dtype:
    """The dtype of format ``weights``' products of more rows than the limit (its entry's ``many_dtype``)."""
    name = weight_format(weights).many_dtype
    if name is None:
        raise ValueError(f"{weights}: not a format of float16-weight layers")
    return getattr(torch, name)
