"""A linear layer whose few-row products read weights held in groups of 32 through our kernel
(``group_matmul.py``: AVX-512 VNNI or AVX2, on tiles of 16 rows) and whose
many-row products take fp16w's (:class:`Fp16Linear`: float16 weights up to ``max_rows`` rows where
that is more than the kernel's, ``many_rows`` beyond: float32, or bfloat16 on AMX tiles). The
formats: :class:`~backend.engine.int4_linear.Int4Linear` (4-bit groups, the decoder layers of
int4w) and :class:`~backend.engine.int8_group_linear.Int8GroupLinear` (8-bit groups, its LM head).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from backend.engine.formats import FEW_ROWS
from backend.engine.fp16_linear import Fp16Linear
from backend.engine.group_matmul import GROUP, Groups, product

# The most rows a product takes through the groups. Measured on an Intel Xeon (family 6 model 167,
# AVX-512 VNNI and AMX), 2 threads, SmolLM2-135M's 121 decode-step products (its 120 layer products
# and its LM head; weights read from memory), milliseconds by rows:
#   rows                            1     4     8    12    16    24    32    64
#   group kernel, AVX-512 VNNI      5.7   7.6  13.8  19.1  21.7  29.2  34.5  54.9
#   group kernel, AVX2              6.4  11.7  20.0     -  34.3     -     -     -
#   oneDNN bfloat16 on AMX tiles    -    18.3  18.6  18.5  19.4  22.0  23.1  27.3
#   fbgemm float16 weights          -    34.8  44.6  49.8  71.8  84.8 106.7 163.7
# Up to 16 rows either kernel is faster than fbgemm's float16 products (which read 212 MB, on one
# thread) and, without AMX, than float32's; bfloat16 on AMX tiles overtakes the VNNI kernel from
# about 12 rows but rounds the activations (held-out argmax agreement 97.4%, the groups' 99.9%).
# So a decode step of up to 16 sequences (the registry's few-row limit) takes the groups; more rows
# take fp16w's products. Read when a layer's product function is made and at each fused decode step.
MAX_ROWS = FEW_ROWS


class GroupLinear(nn.Module):
    """``groups``: its weights in groups of 32 (the subclass quantizes them: ``group_matmul``'s
    :class:`Groups`, not a buffer: ``.to()`` or a state dict must not move or copy them);
    ``group_error``: their largest rounding error (0.0: the groups hold them exactly); ``threads``:
    how many threads the kernel splits a product between. ``product()`` is its forward as a plain
    function (the lean layer loop calls it without the module call). ``max_rows``: fp16w's limit
    (:func:`~backend.engine.fp16_linear.fp16_max_rows`); where it is not above ``MAX_ROWS`` no
    float16 copy is made."""

    def __init__(self, linear: nn.Linear, max_rows: int, many_rows: torch.dtype, groups: Groups, threads: int):
        super().__init__()
        self.in_features, self.out_features, self.max_rows = linear.in_features, linear.out_features, max_rows
        self.groups, self.group_error, self.threads = groups, groups.error, threads
        self.wider = Fp16Linear(linear, max_rows if max_rows > MAX_ROWS else 0, many_rows, ours=False)
        self._forward = self.product()

    def product(self) -> Callable[[torch.Tensor], torch.Tensor]:
        wider, bias, groups, threads = self.wider.product(), self.wider.bias, self.groups, self.threads
        n, k, limit = self.out_features, self.in_features, MAX_ROWS

        def forward(x: torch.Tensor) -> torch.Tensor:
            count = x.numel() // k
            if count > limit:
                return wider(x)
            out = product(groups, x.reshape(count, k).float().contiguous(), threads)
            if bias is not None:
                out += bias
            return out.reshape(*x.shape[:-1], n)

        return forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, weights={self.groups.bits}-bit groups "
            f"of {GROUP} up to {MAX_ROWS} rows with 16-bit activations (largest group error "
            f"{self.group_error:.1e}), "
            + (f"float16 up to {self.wider.max_rows}, " if self.wider.max_rows else "")
            + f"{str(self.wider.many_rows).removeprefix('torch.')} beyond"
        )
