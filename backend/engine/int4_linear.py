"""``weights_dtype=int4w``: the decoder layers' linear weights held as 4-bit groups (32 values
along the input dimension, each ``d * q + m`` with ``q`` in 0..15 and float32 ``d`` and ``m``:
the layout of a GGUF Q4_1 block), multiplied with float32 activations and float32 sums by our
own kernel (``kernels/int4_matmul.c``, AVX2 and FMA, one thread) for products of up to
:data:`INT4_MAX_ROWS` rows (a decode step of up to 4 sequences); products of more rows take
fp16w's (float16 weights through fbgemm up to ``max_rows`` rows, float32 beyond: prefill chunks).
The LM head is fp16w's (``fp16_linear.py``). ``int4w-bf16``: the same, with fp16w-bf16's bfloat16
products on AMX tiles for the many-row ones.

What it reads per weight: half a byte plus a quarter of a byte of group constants (against
float16's two): measured on an Intel Xeon (family 6 model 167), one thread, SmolLM2-135M's
layer shapes, the 120 layer products of a decode step at batch 1 took 12-16 ms against fbgemm's
float16 17-28 ms (same run, alternated; perf figures in the README's status).

Quality: the groups are found from the float32 weights (per group: ``m`` its minimum, ``d`` the
range over 15 rounded to float16, as GGUF does); for a checkpoint converted from a Q4_1 GGUF
(the project's SmolLM2) every group is exact, so the products are float32's up to the order of
the sums. For other checkpoints the rounding is Q4_1's; the load logs how many layers are exact
and the largest error. torch's own int4 kernel (``_weight_int4pack_mm_for_cpu``) was measured
and not used: it is vectorized only for bfloat16 activations, scales and outputs (decode-step
argmax agreement with float32 98.2% on the held-out windows, below auto's 99%), and its float32
path is scalar (15x slower).

The kernel is compiled once per source and CPU (``cc -O3 -mavx2 -mfma``) into the user's cache
(``TRITON_DISAGG_CACHE``, default ``~/.cache/triton-disagg``) and loaded with ctypes (the GIL is
released during the call); without a C compiler the format is refused at load with the reason.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from backend.engine.fp16_linear import Fp16Linear

log = logging.getLogger("triton_disagg.engine")

GROUP = 32
SOURCE = Path(__file__).with_name("kernels") / "int4_matmul.c"
CFLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")


def cache_dir() -> Path:
    return Path(os.environ.get("TRITON_DISAGG_CACHE") or Path.home() / ".cache" / "triton-disagg") / "kernels"


@functools.cache
def kernel() -> Callable[..., None]:
    """The compiled ``int4_matmul`` (built on first use, then loaded from the cache)."""
    source = SOURCE.read_bytes()
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(source + " ".join((compiler, *CFLAGS, platform.machine())).encode()).hexdigest()[:16]
    lib_path = cache_dir() / f"int4_matmul-{key}.so"
    if not lib_path.is_file():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)
        os.close(fd)
        try:
            done = subprocess.run(
                [compiler, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            os.unlink(tmp)
            raise RuntimeError(f"int4w: cannot compile its kernel with {compiler!r}: {e}") from None
        if done.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"int4w: compiling {SOURCE.name} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, lib_path)  # atomic: processes that build at once load a whole file
        log.info("int4w: compiled %s into %s", SOURCE.name, lib_path)
    fn = ctypes.CDLL(str(lib_path)).int4_matmul
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 5
    fn.restype = None
    return fn


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """``weight`` [N, K] (K a multiple of 32) as (packed nibbles [N, K/2] uint8, d [N, K/32],
    m [N, K/32], the largest error relative to its group's range: 0.0 when every group is exact)."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"int4w: in_features {k} is not a multiple of {GROUP}")
    groups = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    d = ((high - low) / 15).half().float()
    q = torch.round((groups - low[..., None]) / torch.where(d == 0, 1.0, d)[..., None]).clamp(0, 15)
    error = ((q * d[..., None] + low[..., None]) - groups).abs().amax(-1) / (high - low).clamp_min(1e-30)
    nibbles = q.to(torch.uint8)
    packed = (nibbles[..., :16] | (nibbles[..., 16:] << 4)).reshape(n, k // 2).contiguous()
    return packed, d.contiguous(), low.contiguous(), float(error.max()) if error.numel() else 0.0


# The most rows a product takes through the 4-bit groups: one row, or a block of 2-4 (padded to
# 4: the kernel converts each group's nibbles once per block). Measured on an Intel Xeon (family 6
# model 167), one thread, SmolLM2-135M's 120 layer products, against fbgemm's float16: 1 row
# 25 ms vs 34-38, 4 rows 33-36 vs 38-45, 8 rows 58-63 vs 45-53 (our kernel is not register-blocked
# like fbgemm's GEMM): more rows take fp16w's products.
INT4_MAX_ROWS = 4


class Int4Linear(nn.Module):
    """A linear layer whose products of at most :data:`INT4_MAX_ROWS` rows read its 4-bit groups,
    and of more rows take fp16w's :class:`Fp16Linear` (float16 weights up to ``max_rows`` rows,
    ``many_rows`` beyond: float32, or bfloat16 on AMX tiles for ``int4w-bf16``). ``product()`` is
    its forward as a plain function (the lean layer loop calls it without the module call)."""

    def __init__(self, linear: nn.Linear, max_rows: int, many_rows: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.max_rows = linear.in_features, linear.out_features, max_rows
        # not buffers: .to() or a state dict must not move or copy them
        self._packed, self._d, self._m, self.group_error = quantize_groups(linear.weight)
        self.wider = Fp16Linear(linear, max_rows, many_rows)
        self._forward = self.product()

    def product(self) -> Callable[[torch.Tensor], torch.Tensor]:
        call, wider, bias = kernel(), self.wider.product(), self.wider.bias
        n, k, limit = self.out_features, self.in_features, min(INT4_MAX_ROWS, self.max_rows)
        pointers = (self._packed.data_ptr(), self._d.data_ptr(), self._m.data_ptr())

        def forward(x: torch.Tensor) -> torch.Tensor:
            count = x.numel() // k
            if count > limit:
                return wider(x)
            rows = x.reshape(count, k).float()
            if 1 < count < 4:  # a block of 4 (the kernel's), padded
                rows = torch.cat([rows, rows.new_zeros(4 - count, k)])
            rows = rows.contiguous()
            sums = rows.view(-1, k // GROUP, GROUP).sum(-1)
            out = torch.empty(rows.shape[0], n)
            call(*pointers, rows.data_ptr(), sums.data_ptr(), out.data_ptr(), rows.shape[0], n, k, 0, n)
            if bias is not None:
                out += bias
            return out[:count].view(*x.shape[:-1], n)

        return forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, weights=int4 groups of "
            f"{GROUP} up to {min(INT4_MAX_ROWS, self.max_rows)} rows (largest group error "
            f"{self.group_error:.1e} of its range), float16 up to {self.max_rows}, float32 beyond"
        )


def quantize_linear_int4(model: nn.Module, max_rows: int, many_rows: torch.dtype = torch.float32) -> nn.Module:
    """``weights_dtype=int4w``: every ``nn.Linear`` of the decoder layers (``model.model.layers``)
    replaced in place by :class:`Int4Linear` (the LM head is left to fp16w's conversion). Logs how
    many are exact 4-bit groups."""
    decoder_layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(decoder_layers, nn.Module):
        raise ValueError(f"int4w: {type(model).__name__} has no decoder layers (model.model.layers)")
    kernel()  # compile (or load) first: a missing compiler fails the load here, with the reason
    layers: list[Int4Linear] = []
    for module in list(decoder_layers.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % GROUP == 0:
                layers.append(Int4Linear(child, max_rows, many_rows))
                setattr(module, name, layers[-1])
    exact = sum(1 for layer in layers if layer.group_error == 0.0)
    worst = max((layer.group_error for layer in layers), default=0.0)
    log.info(
        "int4w: %d linear layers in 4-bit groups of %d, %d exactly (largest error %.1e of a group's range)",
        len(layers),
        GROUP,
        exact,
        worst,
    )
    return model
