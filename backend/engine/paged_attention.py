"""Attention over the paged HND pool, plugged into transformers as attention implementation "paged_hnd".

All tokens of a step are packed into one ``[1, total_tokens]`` sequence. The order is: every
single-token entry first (decodes), then the multi-token prefill chunks. :class:`PagedBatch` holds
the step's metadata as tensors built once per step; transformers forwards it to
:func:`paged_attention` through the model's ``**kwargs`` (keyword ``paged_batch``).

Per layer, :func:`store_kv` writes this step's K/V into the pool (one ``index_put_``) and fires
the ``on_layer_kv_written`` hook, then :func:`attend` attends (the lean layer loop calls the two
directly): decodes as one padded batch gathered from the pool
with ``index_select``, each prefill chunk with its own SDPA call (straight from this step's K/V
when the chunk starts the sequence, else from the pool with an offset causal mask).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from backend.engine.kv_pool import KVPool
from backend.engine.protocol import BatchEntry

ATTN_IMPLEMENTATION = "paged_hnd"


@dataclass
class PrefillSlice:
    token_begin: int
    token_end: int
    context_len: int
    page_ids: torch.Tensor | None  # None: the chunk starts the sequence, attend to this step's K/V
    mask: torch.Tensor | None


@dataclass
class PagedBatch:
    pool: KVPool
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    write_pages: torch.Tensor  # [T]
    write_offsets: torch.Tensor  # [T]
    num_decode: int
    decode_pages: torch.Tensor | None  # [num_decode * max_pages] padded page table, flattened
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_pages * page_size]; None if equal contexts
    decode_context: int | None  # the common context length when decode_mask is None
    prefills: list[PrefillSlice]
    last_token_index: torch.Tensor  # [num_entries], in the caller's entry order
    decode_lengths: list[int] = field(default_factory=list)  # each decode's context, this step's token included
    on_layer_kv_written: Callable[[int, object], None] | None = None
    hook_arg: object = None


def build_paged_batch(entries: list[BatchEntry], pool: KVPool, device: torch.device) -> PagedBatch:
    order = sorted(range(len(entries)), key=lambda i: len(entries[i].token_ids) != 1)
    page_size = pool.page_size
    token_ids, positions, pages, last_index = [], [], [], [0] * len(entries)
    prefills, offset = [], 0
    decode_tables, decode_lens = [], []
    decode_positions, decode_writes = [], []  # one token each: plain ints, one tensor for all below
    for i in order:
        entry = entries[i]
        n = len(entry.token_ids)
        if n == 0:
            raise ValueError("a batch entry must schedule at least one token")
        context_len = entry.start + n
        if len(entry.page_table) * page_size < context_len:
            raise ValueError(f"page table of {len(entry.page_table)} pages cannot hold {context_len} tokens")
        token_ids.extend(entry.token_ids)
        last_index[i] = offset + n - 1
        if n == 1:
            decode_positions.append(entry.start)
            decode_writes.append(entry.page_table[entry.start // page_size])
            decode_tables.append(entry.page_table[: -(-context_len // page_size)])
            decode_lens.append(context_len)
            offset += n
            continue
        pos = torch.arange(entry.start, context_len)
        table = torch.tensor(entry.page_table, dtype=torch.long)
        positions.append(pos)
        pages.append(table[pos // page_size])
        if entry.start == 0:
            prefills.append(PrefillSlice(offset, offset + n, context_len, None, None))
        else:
            used = table[: -(-context_len // page_size)].to(device)
            key_pos = torch.arange(context_len)
            mask = (key_pos[None, :] <= pos[:, None]).to(device)
            prefills.append(PrefillSlice(offset, offset + n, context_len, used, mask))
        offset += n
    if decode_positions:  # the decodes come first (``order``)
        positions.insert(0, torch.tensor(decode_positions, dtype=torch.long))
        pages.insert(0, torch.tensor(decode_writes, dtype=torch.long))
    position_ids = torch.cat(positions)
    decode_pages = decode_mask = decode_context = None
    if decode_tables:
        max_pages = max(len(t) for t in decode_tables)
        padded = torch.tensor([list(t) + [0] * (max_pages - len(t)) for t in decode_tables], dtype=torch.long)
        if min(decode_lens) == max(decode_lens):  # equal contexts: slice the keys instead of masking
            decode_context = decode_lens[0]
        else:
            key_pos = torch.arange(max_pages * page_size)
            decode_mask = (key_pos[None, :] < torch.tensor(decode_lens)[:, None])[:, None, None, :].to(device)
        decode_pages = padded.flatten().to(device)
    return PagedBatch(
        pool=pool,
        input_ids=torch.tensor([token_ids], dtype=torch.long, device=device),
        position_ids=position_ids[None].to(device),
        write_pages=torch.cat(pages).to(device),
        write_offsets=(position_ids % page_size).to(device),
        num_decode=len(decode_tables),
        decode_pages=decode_pages,
        decode_mask=decode_mask,
        decode_context=decode_context,
        prefills=prefills,
        last_token_index=torch.tensor(last_index, dtype=torch.long, device=device),
        decode_lengths=decode_lens,
    )


def paged_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    paged_batch: PagedBatch | None = None,
    **kwargs,
):
    """transformers attention interface: query [1, H, T, D], key/value [1, Hkv, T, D] -> [1, T, H, D]."""
    if paged_batch is None:
        raise RuntimeError("attention 'paged_hnd' needs the paged_batch keyword (run through ModelRunner)")
    kv = torch.stack((key[0].transpose(0, 1), value[0].transpose(0, 1)), dim=1)
    layer_pool = store_kv(paged_batch, module.layer_idx, kv)
    return attend(paged_batch, layer_pool, query[0], key, value, scaling)[None], None


def store_kv(batch: PagedBatch, layer_idx: int, kv: torch.Tensor) -> torch.Tensor:
    """Write this step's K/V of one layer (``kv`` [T, 2, Hkv, D]) into the pool with one
    ``index_put_``, fire the layer's ``on_layer_kv_written`` hook; return the layer's pool."""
    layer_pool = batch.pool.layer(layer_idx)
    layer_pool[batch.write_pages, :, :, batch.write_offsets] = (
        kv if kv.dtype == layer_pool.dtype else kv.to(layer_pool.dtype)
    )
    if batch.on_layer_kv_written is not None:
        batch.on_layer_kv_written(layer_idx, batch.hook_arg)
    return layer_pool


def attend(batch: PagedBatch, layer_pool: torch.Tensor, q: torch.Tensor, key, value, scaling) -> torch.Tensor:
    """q [H, T, D] -> [T, H, D]: decodes from the pool, each prefill chunk from this step's
    ``key``/``value`` ([1, Hkv, T, D]; read only by chunks that start their sequence) or the pool."""
    outputs = []
    if batch.num_decode:
        outputs.append(_decode_attention(q[:, : batch.num_decode], layer_pool, batch, scaling))
    for chunk in batch.prefills:
        q_chunk = q[None, :, chunk.token_begin : chunk.token_end]
        if chunk.page_ids is None:
            k_chunk = key[:, :, chunk.token_begin : chunk.token_end]
            v_chunk = value[:, :, chunk.token_begin : chunk.token_end]
            out = F.scaled_dot_product_attention(
                q_chunk, k_chunk, v_chunk, is_causal=True, scale=scaling, enable_gqa=True
            )
        else:
            kv = _as(_gather_kv(layer_pool, chunk.page_ids)[:, None, :, : chunk.context_len], q)
            out = F.scaled_dot_product_attention(
                q_chunk, kv[0], kv[1], attn_mask=chunk.mask, scale=scaling, enable_gqa=True
            )
        outputs.append(out[0].transpose(0, 1))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


def _gather_kv(layer_pool: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Pages of one layer gathered as [2 (K, V), Hkv, len(page_ids) * page_size, D] in one copy.

    Indexing the page dim of the (2, Hkv, pages, S, D) view yields each head's tokens contiguous,
    so no permute-and-copy follows the gather."""
    _, _, heads, page_size, head_dim = layer_pool.shape
    gathered = layer_pool.permute(1, 2, 0, 3, 4).index_select(2, page_ids)
    return gathered.view(2, heads, page_ids.numel() * page_size, head_dim)


def _as(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The pool's KV in the activations' dtype (``kv_dtype`` may differ from it)."""
    return kv if kv.dtype == q.dtype else kv.to(q.dtype)


def _decode_attention(q: torch.Tensor, layer_pool: torch.Tensor, batch: PagedBatch, scaling):
    """q [H, B, D] (one token per sequence) -> [B, H, D]."""
    num_seqs = batch.num_decode
    assert batch.decode_pages is not None  # set whenever num_decode > 0
    kv = _as(_gather_kv(layer_pool, batch.decode_pages), q)
    kv = kv.view(2, kv.shape[1], num_seqs, -1, kv.shape[-1]).transpose(1, 2)  # [2, B, Hkv, L, D]
    if batch.decode_mask is None:
        kv = kv[:, :, :, : batch.decode_context]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[:, :, None], kv[0], kv[1], attn_mask=batch.decode_mask, scale=scaling, enable_gqa=True
    )
    return out[:, :, 0]


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
