"""A linear layer whose few-row products read weights held in groups of 32 through our kernel
(``group_matmul.py``) and whose many-row products take fp16w's (:class:`Fp16Linear`: float16
weights up to ``max_rows`` rows, ``many_rows`` beyond: float32, or bfloat16 on AMX tiles). The
formats: :class:`~backend.engine.int4_linear.Int4Linear` (4-bit groups, the decoder layers of
int4w) and :class:`~backend.engine.int8_group_linear.Int8GroupLinear` (8-bit groups, its LM head).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from backend.engine.fp16_linear import Fp16Linear
from backend.engine.group_matmul import GROUP

# The most rows a product takes through the groups (the kernel widens each group's weights once
# per block of up to 4 rows). Measured on an Intel Xeon (family 6 model 167), one thread, the 120
# layer products of SmolLM2-135M's decode step on its own weights (read from memory, 80 MB):
# 1 row 11.7 ms, 2 rows 18.9, 3 rows 26.1, 4 rows 26.6; fbgemm's float16 products read 212 MB
# (34-38 ms at 1 row, measured before). On a few weights that stay in the cache the kernel's own
# cost shows instead (5.1, 7.8, 11.0, 13.4 ms against fbgemm's 7.9-8.3): from 3 rows on it
# computes more than it waits. More rows take fp16w's products. Read when a layer's product
# function is made and at each fused decode step.
MAX_ROWS = 4


class GroupLinear(nn.Module):
    """``rows_product(rows [M, K] float32, contiguous, threads) -> [M, N]``: the subclass's kernel call;
    ``group_error``: its weights' largest rounding error (0.0: the groups hold them exactly);
    ``bits``: for its description; ``threads``: how many threads the kernel splits a product
    between. ``product()`` is its forward as a plain function (the lean layer loop calls it
    without the module call)."""

    bits = 0

    def __init__(self, linear: nn.Linear, max_rows: int, many_rows: torch.dtype, group_error: float, threads: int):
        super().__init__()
        self.in_features, self.out_features, self.max_rows = linear.in_features, linear.out_features, max_rows
        self.group_error, self.threads = group_error, threads
        self.wider = Fp16Linear(linear, max_rows, many_rows)
        self._forward = self.product()

    def rows_product(self, rows: torch.Tensor, threads: int) -> torch.Tensor:
        raise NotImplementedError

    def product(self) -> Callable[[torch.Tensor], torch.Tensor]:
        wider, bias, rows_product, threads = self.wider.product(), self.wider.bias, self.rows_product, self.threads
        n, k, limit = self.out_features, self.in_features, min(MAX_ROWS, self.max_rows)

        def forward(x: torch.Tensor) -> torch.Tensor:
            count = x.numel() // k
            if count > limit:
                return wider(x)
            out = rows_product(x.reshape(count, k).float().contiguous(), threads)
            if bias is not None:
                out += bias
            return out.view(*x.shape[:-1], n)

        return forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, weights={self.bits}-bit groups of "
            f"{GROUP} up to {min(MAX_ROWS, self.max_rows)} rows (largest group error {self.group_error:.1e}), "
            f"float16 up to {self.max_rows}, wider beyond"
        )
