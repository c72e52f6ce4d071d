"""Build an engine instance's fabric_bridge agent: its KV layout and registered memory."""
from __future__ import annotations

import os

from fabric_bridge.agent import FabricAgent
from fabric_bridge.layout import KVLayout

from backend.engine import LLMEngine


def kv_layout(engine: LLMEngine) -> KVLayout:
    pool = engine.pool
    model = os.path.basename(os.path.normpath(engine.config.model_path))
    return KVLayout(model=model, num_layers=pool.num_layers, page_size=pool.page_size,
                    num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
                    dtype=str(pool.dtype).removeprefix("torch."), tp_size=1, layout="HND",
                    mem_kind="VRAM" if pool.tensor.is_cuda else "DRAM")


def meta_floats(engine: LLMEngine) -> int:
    """Floats in one metadata slot: last hidden state + logits."""
    return engine.runner.hf_config.hidden_size + engine.runner.vocab_size


def make_agent(engine: LLMEngine, name: str, params: dict, meta_slots: int, on_send_error=None) -> FabricAgent:
    return FabricAgent(name, kv_layout(engine), [engine.pool.tensor], meta_slots=meta_slots,
                       meta_slot_floats=meta_floats(engine),
                       backend=params.get("fabric_backend", "UCX") or "UCX",
                       quarantine_s=float(params.get("kv_quarantine_s", "12") or 12),
                       xfer_timeout_s=float(params.get("kv_xfer_timeout_s", "10") or 10),
                       on_send_error=on_send_error)
