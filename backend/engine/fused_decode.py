"""A decode step's decoder layers as one call into our kernel library (``kernels/decode_step.c``,
``decode_layers``): every decoder layer for up to ``group_linear.MAX_ROWS`` sequences of one token
each (RMS norms, the products, the rotary embedding, the K/V write into the paged HND pool,
attention over each sequence's pages (the (sequence, head) pairs split between the threads), SiLU,
the residual adds, the final norm) without a Python call or a torch dispatch per op. The lean layer loop
(``lean_decoder.py``) spends most of an int4w decode step there: about 600 small ops at batch 1.
The products' weights: int4w's 4-bit groups, float32 (read in place through ``f32_matmul``) or
fp16w's float16 (``f16_matmul`` over :class:`~backend.engine.fp16_linear.Fp16Linear`'s ``half``).

It takes a step only when the step is all decodes, there are at most ``MAX_ROWS`` of them, and no
per-layer hook listens (a prefill instance's layer-wise KV streaming); anything else runs the lean
loop. It applies to a model only when every decoder layer's products are
:class:`~backend.engine.int4_linear.Int4Linear`, or every one float32 weights on the CPU with
inputs a multiple of 16, or every one an ``Fp16Linear`` whose float16 weights our product takes,
without biases; the activations float32 and the pool float32 or float16 on the CPU (float16 K/V
rounded as torch rounds them when written, widened when read), and the head size a multiple of 8
(:func:`unsupported_reason` says why not).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn

from backend.engine import group_linear
from backend.engine.fp16_linear import Fp16Linear
from backend.engine.group_matmul import TILE, f32_unsupported, kernel, library, profiled
from backend.engine.int4_linear import Int4Linear
from backend.engine.kv_pool import KVPool
from backend.engine.lean_decoder import rotary
from backend.engine.paged_attention import PagedBatch

_P = ctypes.c_void_p


class _Layer(ctypes.Structure):  # the order of the C struct's fields
    _fields_ = [
        (name, _P)
        for name in ("norm1", "norm2", "qkv_q", "o_q", "gu_q", "down_q")
        + ("qkv_d", "qkv_m", "o_d", "o_m", "gu_d", "gu_m", "down_d", "down_m")
    ]


_Field = tuple[str, type[ctypes.c_long] | type[ctypes.c_float]]


_DIMS: list[_Field] = [
    *((name, ctypes.c_long) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter")),
    ("eps", ctypes.c_float),
    ("scaling", ctypes.c_float),
    *((name, ctypes.c_long) for name in ("num_pages", "page_size", "max_pages", "kernel", "weights")),
    ("kv_bits", ctypes.c_long),
]
KV_BITS = {torch.float32: 32, torch.float16: 16}  # the pools it reads (float16: widened as read)


class _Dims(ctypes.Structure):
    _fields_ = _DIMS


def unsupported_reason(model: nn.Module, pool: KVPool, weights: int) -> str | None:
    """None when :class:`FusedDecode` can run ``model``'s decode steps over ``pool`` with the
    weights its format's entry names (``formats.WeightFormat.fused``: 4, 16 or 32); else why not."""
    inner: Any = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        return "no decoder layers"
    if pool.dtype not in KV_BITS or pool.device.type != "cpu":
        return f"the KV pool is {pool.dtype} on {pool.device} (float32 or float16 on the CPU only)"
    if pool.head_dim % 8 or pool.head_dim > 512:
        return f"head size {pool.head_dim} (a multiple of 8, at most 512)"
    first = _weights(layers[0].self_attn.qkv_proj) if len(layers) else None
    if first != weights:
        return f"the first product: not the {weights}-bit weights of the format that our kernels take"
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for part in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if _weights(part) != weights or (weights == 32 and part.in_features % 16):
                return f"a product in {type(part).__name__} of {part.in_features} inputs, not as the first one's"
            if (part.wider if weights == 4 else part).bias is not None:
                return "a product with a bias"
            if weights == 4 and part.out_features % TILE:
                return f"a product of {part.out_features} outputs (whole tiles of {TILE} only)"
    if weights != 4 and f32_unsupported() is not None:
        return f"float products: {f32_unsupported()}"
    return None


def _weights(part: nn.Module) -> int | None:
    """4: 4-bit groups; 32: float32 weights on the CPU, contiguous; 16: an ``Fp16Linear`` whose
    float16 weights our product takes; None: none of these."""
    if isinstance(part, Int4Linear):
        return 4
    if isinstance(part, Fp16Linear):
        return 16 if part.half_weight is not None else None
    weight = getattr(part, "weight", None)
    if isinstance(part, nn.Linear) and isinstance(weight, torch.Tensor):
        if weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous():
            return 32
    return None


# the positions whose rotary cos and sin a fused step reads from tables made at load (8 MB at head size 64)
ROPE_TABLE_POSITIONS = 16384


def rope_table(inner: Any, config: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rotary ``cos`` and sign-folded ``sin`` of positions 0 .. ``ROPE_TABLE_POSITIONS`` - 1
    (at most the model's), computed once by the model's own rotary module (row p is what it gives
    for position p alone: the same elementwise ops); None where its frequencies may change with
    the sequence's length (transformers' dynamic and longrope types, which its forward updates)."""
    rope_type = str(getattr(inner.rotary_emb, "rope_type", "default"))
    if "dynamic" in rope_type or rope_type == "longrope":
        return None
    count = min(ROPE_TABLE_POSITIONS, int(getattr(config, "max_position_embeddings", ROPE_TABLE_POSITIONS)))
    cos, sin = rotary(inner, torch.zeros(1, 1, 1), torch.arange(count)[None])
    return cos.contiguous(), sin.contiguous()


class FusedDecode:
    """``forward(batch) -> [B, hidden]`` (after the final norm), or None when the step is not one
    it takes (see the module docstring). ``threads``: how many threads split each product."""

    def __init__(self, model: nn.Module, pool: KVPool, weights: int, threads: int = 1):
        config: Any = model.config
        inner: Any = model.model
        self.inner, self.pool = inner, pool
        head_dim, self.eps = pool.head_dim, config.rms_norm_eps
        self._kernel = library().decode_layers
        self._final_norm = inner.norm.weight
        self._rope_table = rope_table(inner, config)
        argtypes: list[type[ctypes.c_void_p] | type[ctypes.c_long]] = [_P, ctypes.c_long, _P, _P, ctypes.c_long]
        self._kernel.argtypes = argtypes + [_P] * 8 + [ctypes.c_long]
        self.threads = threads
        self._kernel.restype = ctypes.c_int
        self._weights = weights  # 4, 16 or 32: the format's (unsupported_reason checked every product)
        layers = []
        for layer in inner.layers:
            parts = {"norm1": layer.input_layernorm.weight, "norm2": layer.post_attention_layernorm.weight}
            for short, linear in (
                ("qkv", layer.self_attn.qkv_proj),
                ("o", layer.self_attn.o_proj),
                ("gu", layer.mlp.gate_up_proj),
                ("down", layer.mlp.down_proj),
            ):
                if self._weights == 4:
                    groups = linear.groups
                    parts.update({f"{short}_q": groups.q, f"{short}_d": groups.d, f"{short}_m": groups.m})
                else:  # float32 or float16: the weight in the q pointer, read in place
                    parts[f"{short}_q"] = linear.weight if self._weights == 32 else linear.half_weight
            layers.append(_Layer(**{name: tensor.data_ptr() for name, tensor in parts.items()}))
        self._layers = (_Layer * len(layers))(*layers)
        self._num_layers = len(layers)
        self._dims = dict(
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=pool.num_kv_heads,
            head_dim=head_dim,
            inter=inner.layers[0].mlp.down_proj.in_features,
            eps=self.eps,
            scaling=head_dim**-0.5,
            num_pages=pool.num_pages,
            page_size=pool.page_size,
            kernel=kernel(),
            weights=self._weights,
            kv_bits=KV_BITS[pool.dtype],
        )

    def _cos_sin(self, h: torch.Tensor, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rotary ``cos`` and sign-folded ``sin`` ([B, D] each): rows of the tables made
        at load where they hold the step's positions, else computed as the lean loop does."""
        if self._rope_table is not None and max(batch.decode_lengths) <= len(self._rope_table[0]):
            positions = batch.position_ids[0]
            return self._rope_table[0].index_select(0, positions), self._rope_table[1].index_select(0, positions)
        cos, sin = rotary(self.inner, h, batch.position_ids)
        return cos.contiguous(), sin.contiguous()

    def forward(self, batch: PagedBatch) -> torch.Tensor | None:
        count = batch.num_decode
        if (
            batch.prefills
            or not count
            or count > group_linear.MAX_ROWS
            or batch.on_layer_kv_written is not None
            or batch.decode_pages is None
        ):
            return None
        h = self.inner.embed_tokens(batch.input_ids)  # [1, B, hidden]
        cos, sin = self._cos_sin(h, batch)
        h = h[0].contiguous()
        tables = batch.decode_pages
        lengths = torch.tensor(batch.decode_lengths, dtype=torch.long)
        dims = _Dims(**self._dims, max_pages=tables.numel() // count)
        with profiled("group_kernel::decode_layers"):
            rc = self._kernel(
                self._layers,
                self._num_layers,
                ctypes.byref(dims),
                h.data_ptr(),
                count,
                cos.data_ptr(),
                sin.data_ptr(),
                self.pool.tensor.data_ptr(),
                tables.data_ptr(),
                lengths.data_ptr(),
                batch.write_pages.data_ptr(),
                batch.write_offsets.data_ptr(),
                self._final_norm.data_ptr(),
                self.threads,
            )
        if rc == -2:
            raise ValueError("fused decode: the kernel library refused the products (see kernels/decode_step.c)")
        if rc != 0:
            raise MemoryError("fused decode: no memory for the step's activations")
        return h  # the final norm applied by the kernel
