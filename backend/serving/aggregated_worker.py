"""Aggregated worker: one engine does chunked prefill and decode in the same batches."""
from __future__ import annotations

from backend.engine.engine_loop import EngineLoop
from backend.serving.session import GenerationSession
from backend.serving.worker_common import build_engine, deliver, pool_gauges, sampling_params, speculation_defaults


class AggregatedWorker:
    def __init__(self, model_path: str, params: dict, name: str):
        self.config, self.engine = build_engine(model_path, params)
        self.loop = EngineLoop(self.engine, name=f"{name}-engine")
        self.max_model_len = self.engine.max_model_len
        self.spec_defaults = speculation_defaults(params)

    def describe(self) -> str:
        c = self.config
        pool = self.engine.pool
        return (f"device {c.torch_device}, dtype {c.dtype}, KV pool {c.num_pages} pages x {c.page_size} tokens "
                f"({pool.tensor.numel() * pool.tensor.element_size() / 2**20:.0f} MiB, HND), "
                f"max_model_len {self.max_model_len}, token budget {c.max_num_batched_tokens}/step")

    def submit(self, session: GenerationSession) -> None:
        self.loop.submit(session.req_id, session.prompt_ids, sampling_params(session, self.spec_defaults),
                         lambda out: deliver(session, out))

    def cancel(self, req_id: str) -> None:
        self.loop.cancel(req_id)

    def stats(self) -> dict:
        return pool_gauges(self.engine.pool_stats())

    def shutdown(self) -> None:
        self.loop.shutdown()
