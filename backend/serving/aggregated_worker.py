"""Aggregated worker: one engine does chunked prefill and decode in the same batches."""

from __future__ import annotations

from collections.abc import Callable

from backend.engine.cache_summary import CacheSummary
from backend.engine.engine_loop import EngineLoop
from backend.serving.config import InstanceConfig
from backend.serving.session import GenerationSession
from backend.serving.stats import AggregatedStats
from backend.serving.worker import Responder, sampling_params, start_engine


class AggregatedWorker:
    def __init__(self, config: InstanceConfig, name: str):
        self.config = config
        self.engine = start_engine(config)
        self.loop = EngineLoop(self.engine, name=f"{name}-engine")
        self.responder = Responder(name)
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.dims().vocab_size
        self.end_ids = tuple(self.engine.default_end_ids)

    def describe(self) -> str:
        c, kv = self.config.engine, self.engine.kv_cache()
        return (
            f"device {c.torch_device}, weights {c.weights_format}, KV pool {c.num_pages} pages x {c.page_size} tokens "
            f"of {c.kv_format} "
            f"({kv.total_bytes / 2**20:.0f} MiB, HND), "
            f"max_model_len {self.max_model_len}, token budget {c.max_num_batched_tokens}/step"
        )

    def submit(self, session: GenerationSession) -> None:
        self.loop.submit(
            session.req_id,
            session.prompt_ids,
            sampling_params(session, self.config.serving),
            lambda out: self.responder.deliver(session, out),
        )

    def cancel(self, req_id: str) -> None:
        self.loop.cancel(req_id)

    def stats(self) -> AggregatedStats:
        s = AggregatedStats()
        s.set_pool(self.engine.pool_stats())
        return s

    def observations(self) -> dict[str, list[float]]:
        return {}  # TTFT, ITL and request latency come from the sessions, in the model

    def on_out_of_service(self, callback: Callable[[str], None]) -> None:
        self.engine.on_out_of_service(callback)

    def health(self) -> str | None:
        return self.engine.health()

    def cache_summary(self) -> CacheSummary:
        return self.engine.cache_summary()

    def in_flight(self) -> int:
        return self.engine.cache_summary().running

    def leave(self, final: bool) -> None:
        """An aggregated instance has no membership record."""

    def member_name(self) -> str | None:
        return None

    def shutdown(self) -> None:
        self.loop.shutdown()
        self.responder.close()
        self.engine.close()
