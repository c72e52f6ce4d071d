"""Shard a loaded transformers decoder (Llama/Qwen/Mistral family) in place for one TP rank.

Megatron-style split: q/k/v and gate/up are column-parallel (each rank keeps its slice of
output features: its query heads, its KV heads, its part of the MLP), o_proj and down_proj
are row-parallel (each rank multiplies its slice of input features, then the partial results
are summed with an all-reduce; a bias is added once, after the sum). Embeddings, norms and
lm_head stay replicated. With contiguous head slices, rank r's query heads use exactly its KV
heads (GQA groups never straddle ranks when the TP size divides the KV head count).

The layer-complete signal: :class:`LayerSignal` fires after a layer's o_proj all-reduce is
queued. Every rank reaches that all-reduce only after its own attention for the layer, so
once the all-reduce has run (the device mark the lead makes next, see ``lead.py``) every rank
has written the layer's KV into its shard of the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backend.parallel.comm import all_reduce


class LayerSignal:
    """Holds the current step's ``hook(layer_idx, arg)``; fired by the o_proj reductions."""

    def __init__(self):
        self.hook: Callable[[int, object], None] | None = None
        self.arg: object = None

    def fire(self, layer_idx: int) -> None:
        if self.hook is not None:
            self.hook(layer_idx, self.arg)


class RowParallelLinear(nn.Module):
    """This rank's input-feature slice of a Linear; all-reduces the output, then adds the bias."""

    def __init__(
        self, linear: nn.Linear, rank: int, world: int, group, layer_idx: int = -1, signal: LayerSignal | None = None
    ):
        super().__init__()
        cols = linear.in_features // world
        self.weight = nn.Parameter(linear.weight.data[:, rank * cols : (rank + 1) * cols].clone(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        self.group, self.layer_idx, self.signal = group, layer_idx, signal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        all_reduce(self.group, out)
        if self.bias is not None:
            out = out + self.bias
        if self.signal is not None:
            self.signal.fire(self.layer_idx)
        return out


def _column(linear: nn.Linear, rank: int, world: int) -> None:
    rows = linear.out_features // world
    part = slice(rank * rows, (rank + 1) * rows)
    linear.weight = nn.Parameter(linear.weight.data[part].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[part].clone(), requires_grad=False)
    linear.out_features = rows


def check_shardable(hf_config, world: int) -> None:
    """Refuse a TP size that does not split heads and MLP evenly (no KV replication in the engine)."""
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    inter = hf_config.intermediate_size
    if heads % world or kv % world or inter % world:
        raise ValueError(
            f"tensor_parallel_size {world} must divide the query heads ({heads}), the KV heads "
            f"({kv}) and the MLP width ({inter}); replicated KV heads are not supported "
            "by the torch engine"
        )


def shard_model(model: nn.Module, rank: int, world: int, group, signal: LayerSignal | None) -> None:
    """Replace each decoder layer's projections by this rank's shards (see module docstring)."""
    check_shardable(model.config, world)
    decoder: Any = model.model  # nn.Module types submodule attributes as Tensor | Module
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _column(lin, rank, world)
        attn.o_proj = RowParallelLinear(attn.o_proj, rank, world, group, attn.layer_idx, signal)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world, group)
