"""The decoder's forward as one lean layer loop over fused weights (Llama-family checkpoints).

transformers' per-layer modules spend a decode step of a small model largely between matrix
products: ~90 tensor ops per layer (separate q/k/v and gate/up products, the rotary embedding of
q and k apart, module calls around each), each a Python call and a dispatch. This loop runs the
same computation in fewer: q/k/v as one product and gate/up as one (their weights
concatenated), the rotary embedding of q and k in one pass over their joint slice, written back
into the product's output so that its K/V part goes to the pool as it is (no stacking copy), the
norms through ``F.rms_norm``, the group, fp16w and float32 products as those layers' own functions,
attention through the pieces of the paged attention (:func:`store_kv`, :func:`attend`).

Same weights, same operations on each element (the rotary embedding as a multiply and an add,
not ``addcmul``, whose fused multiply-add rounds once); a fused product may sum in another order
than the separate ones (last bits). The fused modules
replace the separate ones in the model (``qkv_proj``, ``gate_up_proj``), so the weights are held
once; a model so changed runs through this loop only. Measured in ``perf/history/REPORT-2026-12-02.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backend.engine.paged_attention import PagedBatch, attend, store_kv

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_LAYER_PARTS = {*_ATTENTION, *(f"mlp.{name}" for name in _MLP)}
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}

# A linear layer's product as a plain function of its input (see _product).
_Product = Callable[[torch.Tensor], torch.Tensor]


def unsupported_reason(model: nn.Module) -> str | None:
    """None when every layer of ``model`` (a transformers causal LM) has exactly the parts this
    loop computes; else what differs."""
    config = model.config
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return f"{type(model).__name__} has no decoder layers with a rotary embedding"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} (the loop computes silu)"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None:
            return "a layer without self_attn and mlp"
        parts = {*_weighted_children(attn), *(f"mlp.{name}" for name in _weighted_children(mlp))}
        if parts != _LAYER_PARTS:
            return f"layer parts {sorted(parts ^ _LAYER_PARTS)} differ from a Llama layer"
        if not all(type(getattr(attn, n)) is nn.Linear for n in _ATTENTION) or not all(
            type(getattr(mlp, n)) is nn.Linear for n in _MLP
        ):
            return "a projection that is not a plain linear layer"
        if set(_weighted_children(layer)) != _LAYER_CHILDREN:
            return "layer children differ from a Llama layer"
    return None


def _weighted_children(module: nn.Module) -> list[str]:
    """Names of the children that hold weights (an activation module holds none)."""
    return [name for name, child in module.named_children() if any(True for _ in child.parameters())]


def _fused(parts: list[nn.Linear]) -> nn.Linear:
    """One linear layer computing ``parts`` side by side (their outputs concatenated)."""
    first = parts[0]
    out = nn.Linear(
        first.in_features,
        sum(p.out_features for p in parts),
        bias=first.bias is not None,
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        out.weight.copy_(torch.cat([p.weight for p in parts]))
        if first.bias is not None:
            out.bias.copy_(torch.cat([p.bias for p in parts]))
    return out


def fuse_projections(model: nn.Module) -> None:
    """Replace each layer's q/k/v projections by ``self_attn.qkv_proj`` and its gate/up ones by
    ``mlp.gate_up_proj`` (in place; run before any quantization, which then covers them)."""
    inner: Any = model.model  # nn.Module types submodule attributes as Tensor | Module
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _fused([attn.q_proj, attn.k_proj, attn.v_proj])
        mlp.gate_up_proj = _fused([mlp.gate_proj, mlp.up_proj])
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj


def rotary(inner: Any, h: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding's ``cos`` and sign-folded ``sin`` ([T, D] each) for ``h`` [1, T, hidden]:
    x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1), is x * cos + roll(x, D/2) * this
    sin (roll(x, D/2) = (x2, x1))."""
    cos, sin = inner.rotary_emb(h, position_ids)  # [1, T, D]
    half = sin.shape[-1] // 2
    return cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)


def _product(linear: nn.Module) -> _Product:
    """A linear layer's product as a plain function of its input: for the layers that make one
    (``product()``: the group and fp16w layers) that function itself (their module call adds as
    much Python as the op's own dispatch, 121 times a step), for the others the module's
    ``forward`` without ``__call__``'s hook handling."""
    product = getattr(linear, "product", None)
    return product() if callable(product) else linear.forward


class LeanDecoder:
    """``forward(batch) -> [T, hidden]``: the final hidden states (after the final norm) of a
    model whose projections :func:`fuse_projections` fused."""

    def __init__(self, model: nn.Module):
        # transformers' config and submodules (nn.Module types its attributes as Tensor | Module)
        config: Any = model.config
        inner: Any = model.model
        self.inner = inner
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps: float = config.rms_norm_eps
        self.scaling = self.head_dim**-0.5
        self.layers: list[tuple[int, torch.Tensor, _Product, _Product, torch.Tensor, _Product, _Product]] = [
            (
                i,
                layer.input_layernorm.weight,
                _product(layer.self_attn.qkv_proj),
                _product(layer.self_attn.o_proj),
                layer.post_attention_layernorm.weight,
                _product(layer.mlp.gate_up_proj),
                _product(layer.mlp.down_proj),
            )
            for i, layer in enumerate(inner.layers)
        ]

    def forward(self, batch: PagedBatch) -> torch.Tensor:
        h: torch.Tensor = self.inner.embed_tokens(batch.input_ids)  # [1, T, hidden]
        cos, sin = rotary(self.inner, h, batch.position_ids)
        cos, sin = cos[:, None], sin[:, None]  # [T, 1, D]
        tokens, heads, kv_heads, dim = h.shape[1], self.num_heads, self.num_kv_heads, self.head_dim
        half = dim // 2
        h = h[0]
        hidden = (h.shape[-1],)
        qk_heads = heads + kv_heads
        first_chunks = any(chunk.page_ids is None for chunk in batch.prefills)
        for layer_idx, norm1, qkv_proj, o_proj, norm2, gate_up_proj, down_proj in self.layers:
            x = F.rms_norm(h, hidden, norm1, self.eps)
            qkv = qkv_proj(x).view(tokens, qk_heads + kv_heads, dim)
            qk = qkv[:, :qk_heads]
            torch.add(qk * cos, qk.roll(half, -1) * sin, out=qk)  # q and k rotated in place
            layer_pool = store_kv(batch, layer_idx, qkv[:, heads:].view(tokens, 2, kv_heads, dim))
            key = value = None
            if first_chunks:  # a chunk that starts its sequence attends to this step's K/V directly
                key = qkv[:, heads:qk_heads].transpose(0, 1)[None]
                value = qkv[:, qk_heads:].transpose(0, 1)[None]
            attn = attend(batch, layer_pool, qkv[:, :heads].transpose(0, 1), key, value, self.scaling)
            h = h + o_proj(attn.reshape(tokens, heads * dim))
            gate, up = gate_up_proj(F.rms_norm(h, hidden, norm2, self.eps)).chunk(2, dim=-1)
            h = h + down_proj(F.silu(gate) * up)
        return F.rms_norm(h, hidden, self.inner.norm.weight, self.eps)
