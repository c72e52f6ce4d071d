"""Driving a decode-role engine by hand, without a receiving connector: a KV loader that takes
every ``remote_kv`` request and records its pages, and the admission of one such request (the
scheduler gives it its pages; it then waits for its KV). The GPU check (``perf/gpu_check.py``)
and the engine tests move KV into those pages themselves, then call ``engine.kv_loaded``."""

from __future__ import annotations

from backend.engine.llm_engine import LLMEngine


class RemoteLoader:
    """A KV loader (the engine's seam to a receiving connector) that takes every ``remote_kv``
    request, or none (``remote=False``), recording the pages and cached tokens each got."""

    def __init__(self, remote: bool = True):
        self.remote = remote
        self.pages: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}

    def load(self, req_id: str, token_ids: list[int], page_table: list[int], cached_tokens: int) -> bool:
        self.pages[req_id], self.cached[req_id] = list(page_table), cached_tokens
        return self.remote


def admit_remote(engine: LLMEngine, req_id: str, prompt: list[int], params=None, max_steps: int = 100) -> list[int]:
    """Add a ``remote_kv`` request and step until the scheduler gave it its pages and it waits for
    its KV; returns its page table (write the KV there, then ``engine.kv_loaded``). A
    :class:`RemoteLoader` is set when the engine has no loader. Outputs of other requests that
    these steps produce are dropped. Raises ``RuntimeError`` when it is not admitted within
    ``max_steps`` steps (the pool full)."""
    if engine.kv_loader is None:
        engine.set_kv_loader(RemoteLoader())
    engine.add_request(req_id, prompt, params, remote_kv=True)
    for _ in range(max_steps):
        if req_id in engine.scheduler.parked:
            return engine.allocator.page_table(req_id)
        engine.step()
    raise RuntimeError(f"{req_id}: not admitted within {max_steps} engine steps (pool full?)")
