"""Linear layers for the few-row products of decode steps on the CPU.

A decode step multiplies a handful of rows (one per running sequence) by each weight matrix.
``F.linear(x, W)`` (x times W transposed) sends one row to MKL's matrix-vector kernel, but two to
eight rows to its matrix-matrix kernel, which on this machine takes about twice as long as the
matrix-vector one for the same weights: a batch of 2 decoding sequences cost ~1.5x the step of 1.
Computing ``(W @ x.T).T`` instead reads each weight once for all rows and is as fast as the
matrix-vector kernel for up to 4 rows (the LM head, 49152 x 576, up to 8); with more rows, the
ordinary path is faster again. Same products, summed in another order: outputs may differ from
``F.linear`` in the last bits (greedy tokens are unchanged in the engine's tests against
transformers). Measured in ``perf/history/REPORT-2026-12-02.md`` (decode step at batch 2: 96 -> 49 ms, 2 threads).
"""

from __future__ import annotations

import torch

MAX_ROWS = 4
MAX_ROWS_LM_HEAD = 8


class SmallBatchLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose products of at most ``max_rows`` rows run as ``W @ x.T``."""

    max_rows = MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > self.max_rows or x.dtype != self.weight.dtype:
            return super().forward(x)
        # contiguous: callers (xgrammar's in-place token mask among them) expect row-major output
        out = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.weight.shape[0])


class SmallBatchLMHead(SmallBatchLinear):
    """The LM head: up to 8 rows; a single row is doubled, since two rows through ``W @ x.T``
    take half the time of one through the matrix-vector kernel (measured: 5.3 vs 10.4 ms)."""

    max_rows = MAX_ROWS_LM_HEAD

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1] and x.dtype == self.weight.dtype:
            row = x.reshape(1, x.shape[-1])
            return super().forward(torch.cat([row, row]))[:1].reshape(*x.shape[:-1], self.weight.shape[0])
        return super().forward(x)


def use_small_batch_linears(model: torch.nn.Module) -> int:
    """Turn the model's ``nn.Linear`` layers (CPU, float weights) into :class:`SmallBatchLinear`
    in place (the LM head into :class:`SmallBatchLMHead`); returns how many."""
    head = getattr(model, "lm_head", None)
    n = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.is_floating_point():
            m.__class__ = SmallBatchLMHead if m is head else SmallBatchLinear
            n += 1
    return n
