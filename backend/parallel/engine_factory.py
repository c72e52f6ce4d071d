"""Build an engine instance for its tensor-parallel size: a plain model runner for TP 1, the
lead of a group of rank processes (``backend/parallel/lead.py``) otherwise."""

from __future__ import annotations

from backend.engine.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.engine.model_runner import ModelRunner
from backend.engine.shared_tier import BlockStore


def build_engine(config: EngineConfig, store: BlockStore | None = None) -> LLMEngine:
    """``store``: the shared KV tier's store, or None (a TP instance has no tiers)."""
    if config.tensor_parallel_size == 1:
        return LLMEngine(config, ModelRunner(config), store)
    from backend.parallel.lead import TPLeadRunner  # loads torch.distributed only when needed

    return LLMEngine(config, TPLeadRunner(config))
