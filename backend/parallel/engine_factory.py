"""Build an engine instance for its tensor-parallel size: a plain model runner (or the emulated
engine's) for TP 1, the lead of a group of rank processes (``backend/parallel/lead.py``) otherwise."""

from __future__ import annotations

from collections.abc import Callable

from backend.engine.config import EngineConfig
from backend.engine.file_reader import FileReader
from backend.engine.llm_engine import LLMEngine, make_runner
from backend.engine.shared_tier import BlockStore


def build_engine(
    config: EngineConfig, store: BlockStore | None = None, disk_reader: Callable[[], FileReader | None] | None = None
) -> LLMEngine:
    """``store``: the shared KV tier's store, ``disk_reader`` what builds the disk tier's reader,
    or None (a TP instance has no tiers)."""
    if config.tensor_parallel_size == 1:
        return LLMEngine(config, make_runner(config), store, disk_reader)
    from backend.parallel.lead import TPLeadRunner  # loads torch.distributed only when needed

    return LLMEngine(config, TPLeadRunner(config))
