"""Build an engine instance's fabric_bridge agent: its KV layout and registered memory.

A tensor-parallel instance has one agent for all its ranks: the lead maps every rank's shard
pool (shared memory), so the layout has ``tp_size`` = the instance's TP size and the agent
registers each rank's pool as one shard."""
from __future__ import annotations

import os

from fabric_bridge.agent import FabricAgent
from fabric_bridge.layout import KVLayout

from backend.engine.llm_engine import LLMEngine


def shard_pools(engine: LLMEngine) -> list:
    """Every rank's KV pool tensor, in rank order (one for TP 1)."""
    return getattr(engine.runner, "shard_pools", None) or [engine.pool.tensor]


def kv_layout(engine: LLMEngine) -> KVLayout:
    pool = engine.pool
    tp = len(shard_pools(engine))
    model = os.path.basename(os.path.normpath(engine.config.model_path))
    return KVLayout(model=model, num_layers=pool.num_layers, page_size=pool.page_size,
                    num_kv_heads=pool.num_kv_heads * tp, head_dim=pool.head_dim,
                    dtype=str(pool.dtype).removeprefix("torch."), tp_size=tp, layout="HND",
                    mem_kind="VRAM" if pool.tensor.is_cuda else "DRAM")


def meta_floats(engine: LLMEngine) -> int:
    """Floats in one metadata slot: last hidden state + logits."""
    return engine.runner.hf_config.hidden_size + engine.runner.vocab_size


def make_agent(engine: LLMEngine, name: str, params: dict, meta_slots: int, on_send_error=None) -> FabricAgent:
    return FabricAgent(name, kv_layout(engine), shard_pools(engine), meta_slots=meta_slots,
                       meta_slot_floats=meta_floats(engine),
                       backend=params.get("fabric_backend", "UCX") or "UCX",
                       quarantine_s=float(params.get("kv_quarantine_s", "12") or 12),
                       xfer_timeout_s=float(params.get("kv_xfer_timeout_s", "10") or 10),
                       on_send_error=on_send_error)
