"""Build an engine instance for its tensor-parallel size: a plain model runner for TP 1, the
lead of a group of rank processes (``backend/parallel/lead.py``) otherwise."""

from __future__ import annotations

from backend.engine.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.engine.model_runner import ModelRunner


def build_engine(config: EngineConfig) -> LLMEngine:
    if config.tensor_parallel_size == 1:
        return LLMEngine(config, ModelRunner(config))
    from backend.parallel.lead import TPLeadRunner  # loads torch.distributed only when needed

    return LLMEngine(config, TPLeadRunner(config))
