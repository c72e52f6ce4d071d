"""A linear layer whose few-row products read weights held in groups of 32 through our kernel
(``group_matmul.py``: tiles of 16 rows with AVX-512 VNNI, rows in order with AVX2) and whose
many-row products take fp16w's (:class:`Fp16Linear`: float16 weights up to ``max_rows`` rows where
that is more than the kernel's, ``many_rows`` beyond: float32, or bfloat16 on AMX tiles). The
formats: :class:`~backend.engine.int4_linear.Int4Linear` (4-bit groups, the decoder layers of
int4w) and :class:`~backend.engine.int8_group_linear.Int8GroupLinear` (8-bit groups, its LM head).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from backend.engine.fp16_linear import Fp16Linear
from backend.engine.group_matmul import GROUP, TILE, tiles_available

# The most rows a product takes through the groups. Measured on an Intel Xeon (family 6 model 167,
# AVX-512 VNNI and AMX), 2 threads, SmolLM2-135M's 121 decode-step products (its 120 layer products
# and its LM head; weights read from memory), milliseconds by rows:
#   rows                            1     4     8    12    16    24    32    64
#   tiles of 16 rows (AVX-512 VNNI) 6.3   8.6  15.3  19.1  22.5  29.2  34.5  54.9
#   rows in order (AVX2 kernel)     8.7  19.0  32.5     -  56.3     -     -     -
#   oneDNN bfloat16 on AMX tiles    -    18.3  18.6  18.5  19.4  22.0  23.1  27.3
#   fbgemm float16 weights          -    34.8  44.6  49.8  71.8  84.8 106.7 163.7
# Up to 16 rows either kernel is faster than fbgemm's float16 products (which read 212 MB, on one
# thread) and, without AMX, than float32's; bfloat16 on AMX tiles overtakes the tiles from about
# 12 rows but rounds the activations (held-out argmax agreement 97.4%, the groups' 99.9%). So a
# decode step of up to 16 sequences takes the groups; more rows take fp16w's products. Read when a
# layer's product function is made and at each fused decode step.
MAX_ROWS = 16


class GroupLinear(nn.Module):
    """``rows_product(rows [M, K] float32, contiguous, threads) -> [M, N]``: the subclass's kernel call;
    ``group_error``: its weights' largest rounding error (0.0: the groups hold them exactly);
    ``bits``: for its description; ``threads``: how many threads the kernel splits a product
    between; ``tiled``: its weights in the kernel's tiles of 16 rows (:func:`uses_tiles`).
    ``product()`` is its forward as a plain function (the lean layer loop calls it without the
    module call). ``max_rows``: fp16w's limit (:func:`~backend.engine.fp16_linear.fp16_max_rows`);
    where it is not above ``MAX_ROWS`` no float16 copy is made."""

    bits = 0

    def __init__(
        self, linear: nn.Linear, max_rows: int, many_rows: torch.dtype, group_error: float, threads: int, tiled: bool
    ):
        super().__init__()
        self.in_features, self.out_features, self.max_rows = linear.in_features, linear.out_features, max_rows
        self.group_error, self.threads, self.tiled = group_error, threads, tiled
        self.wider = Fp16Linear(linear, max_rows if max_rows > MAX_ROWS else 0, many_rows)
        self._forward = self.product()

    def rows_product(self, rows: torch.Tensor, threads: int) -> torch.Tensor:
        raise NotImplementedError

    def product(self) -> Callable[[torch.Tensor], torch.Tensor]:
        wider, bias, rows_product, threads = self.wider.product(), self.wider.bias, self.rows_product, self.threads
        n, k, limit = self.out_features, self.in_features, MAX_ROWS

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
        layout = "tiles of 16 rows" if self.tiled else "rows in order"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, weights={self.bits}-bit groups of "
            f"{GROUP} ({layout}) up to {MAX_ROWS} rows (largest group error {self.group_error:.1e}), "
            + (f"float16 up to {self.wider.max_rows}, " if self.wider.max_rows else "")
            + f"{str(self.wider.many_rows).removeprefix('torch.')} beyond"
        )


def uses_tiles(out_features: int) -> bool:
    """Whether a layer with ``out_features`` outputs holds its groups in tiles of 16 rows: where the
    kernel has them (AVX-512 VNNI, ``group_matmul.tiles_available``) and 16 divides its outputs."""
    return out_features % TILE == 0 and tiles_available()
