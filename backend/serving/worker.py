"""The worker behind a model instance, as the Triton layer sees it (:class:`Instance`, every role;
:class:`Worker`, the client-facing ones), and what
every worker shares (building the engine, turning a client request into sampling parameters,
handing engine outputs to the session, the KV-pool gauges)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from backend.cluster.kv_store import RedisBlockStore
from backend.engine.cache_summary import CacheSummary
from backend.engine.config import EngineConfig
from backend.engine.file_reader import FileReader
from backend.engine.outputs import EngineOutput
from backend.engine.protocol import Engine
from backend.engine.sampling_params import SamplingParams
from backend.parallel.engine_factory import build_engine
from backend.serving.config import InstanceConfig, ServingConfig
from backend.serving.session import GenerationSession
from backend.serving.stats import InstanceStats
from fabric_bridge.file_reader import NixlFileReader


class Instance(Protocol):
    """What every role's worker is to the Triton layer (prefill, decode, aggregated): ``stats``
    feeds the metrics; ``observations`` hands over (and forgets) the latencies measured since the
    last call, by histogram name; ``health`` says why the instance cannot serve now (None: it
    can); ``cache_summary`` what it caches and how loaded it is; ``in_flight`` how many requests
    it holds; ``leave`` takes it out of the membership (first draining, then for good)."""

    def describe(self) -> str: ...
    def stats(self) -> InstanceStats: ...
    def observations(self) -> dict[str, list[float]]: ...
    def health(self) -> str | None: ...
    def cache_summary(self) -> CacheSummary:
        """Its prefix cache and load, for KV-aware routing."""

    def in_flight(self) -> int: ...
    def on_out_of_service(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` once if the instance goes out of service for good (a tensor-parallel
        instance lost a rank)."""

    def leave(self, final: bool) -> None:
        """Draining: tell the membership this instance takes nothing new (``final``: leave it)."""

    def member_name(self) -> str | None:
        """This instance's name in the deployment's membership (None: it is not registered)."""

    def shutdown(self) -> None: ...


class Worker(Instance, Protocol):
    """A client-facing instance (decode, aggregated): it also takes requests from Triton:
    ``submit`` a session (answered through the session), ``cancel`` one. (A prefill instance's
    requests come from decode instances over the messenger, not from Triton.)"""

    max_model_len: int
    vocab_size: int
    end_ids: tuple[int, ...]  # the model's end-of-sequence tokens

    def submit(self, session: GenerationSession) -> None: ...
    def cancel(self, req_id: str) -> None: ...


log = logging.getLogger("triton_disagg.worker")


class Drain:
    """The drain of an instance that Triton sends no requests (a prefill instance; the
    client-facing ones drain through :class:`~backend.serving.admission.Admission`, which also
    refuses new requests): ``start`` marks it draining in the membership (its peers send it
    nothing new), lets what it holds finish for up to ``timeout_s`` on a thread of its own, then
    takes it out of the membership. Once only: a second ``start`` returns None."""

    def __init__(self, instance: Instance, name: str, timeout_s: float):
        self.instance, self.name, self.timeout_s = instance, name, timeout_s
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> threading.Thread | None:
        with self._lock:
            if self._thread is not None or self.instance.member_name() is None:
                return None
            self._thread = threading.Thread(target=self._run, name=f"{self.name}-drain", daemon=True)
        self.instance.leave(final=False)
        log.warning("%s: draining: no new requests; %d in flight may finish", self.name, self.instance.in_flight())
        self._thread.start()
        return self._thread

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self.instance.in_flight() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.instance.leave(final=True)
        log.warning("%s: drained (%d request(s) left); left the membership", self.name, self.instance.in_flight())


def start_engine(config: InstanceConfig) -> Engine:
    """Pin the process (``cpu_affinity``), then build this instance's engine (with the shared KV
    tier's store when ``kv_store_url`` names one, and its disk tier's reader)."""
    config.serving.apply_cpu_affinity()
    engine = config.engine
    store = RedisBlockStore(engine.kv_store_url, engine.kv_store_timeout_s) if engine.kv_store_url else None
    return build_engine(engine, store, lambda: disk_reader(engine))


def disk_reader(engine: EngineConfig) -> FileReader | None:
    """What the disk KV tier reads with (``kv_disk_reader``; the engine asks when it builds one):
    NIXL's POSIX file backend, or None (the engine's plain file I/O). ``auto`` takes NIXL's where
    it starts and says why not otherwise; ``nixl`` refuses to start without it."""
    if engine.kv_disk_reader == "plain":
        return None
    try:
        return NixlFileReader()
    except Exception as e:
        if engine.kv_disk_reader == "nixl":
            raise RuntimeError(f"kv_disk_reader=nixl: NIXL's POSIX file backend cannot start ({e})") from e
        log.warning(
            "disk KV tier: NIXL's POSIX file backend cannot start (%s: %s); plain file I/O", type(e).__name__, e
        )
        return None


def sampling_params(session: GenerationSession, serving: ServingConfig) -> SamplingParams:
    r = session.request
    top = r.num_top_log_probs
    logprobs = top if r.return_log_probs else None
    prompt_logprobs = top if r.return_prompt_log_probs else None
    k = serving.speculative_k if r.num_draft_tokens is None else r.num_draft_tokens
    if logprobs is not None or prompt_logprobs is not None:
        k = 0  # the model's default drafting gives way (a request that asks for drafts is refused)
    return SamplingParams(
        max_tokens=max(1, r.remaining_tokens),  # a scoring request (0) runs one step; its token is dropped
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        seed=r.seed,
        end_ids=(r.end_id,) if r.end_id is not None else (),
        ignore_eos=r.ignore_eos,
        min_tokens=max(0, r.min_length - len(r.resume_ids)),
        num_draft_tokens=k,
        draft_method=r.draft_method or serving.draft_method,
        grammar=r.grammar,
        grammar_prefix=tuple(r.resume_ids) if r.grammar is not None else (),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        cache_salt=r.cache_salt,
    )


class Responder:
    """Hands engine outputs to their sessions on a thread of its own, in the order the engine made
    them, so that the engine's next step does not wait for the response path (a session checks
    its client's cancellation, detokenizes and sends through Triton's response sender: about
    0.55 ms a response here, mostly waiting on Triton's IPC; 12% of a one-stream decode step).
    Measured on a Zen 4 with 2 cores (``bench one-stream``, alternated): a disaggregated decode
    instance's one stream +9% tokens/s and 8 streams' ITL p50 -15%; aggregated (both cores
    busy with the engine) unchanged. At most ``backlog`` outputs wait; past it the engine thread
    waits (as before, when it sent them itself)."""

    def __init__(self, name: str, backlog: int = 1024):
        self._queue: queue.Queue[tuple[GenerationSession, EngineOutput] | None] = queue.Queue(backlog)
        self._thread = threading.Thread(target=self._run, name=f"{name}-responses", daemon=True)
        self._thread.start()

    def deliver(self, session: GenerationSession, out: EngineOutput) -> None:
        """Queue one engine output for its session (engine loop thread)."""
        self._queue.put((session, out))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            session, out = item
            try:
                session.on_output(
                    out.new_token_ids,
                    out.finished,
                    out.finish_reason,
                    out.error,
                    out.error_kind,
                    logprobs=out.logprobs,
                    prompt_logprobs=out.prompt_logprobs,
                )
            except Exception:
                log.exception("request %s: handing an engine output to its session failed", session.req_id)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)


@dataclass(frozen=True)
class EngineDone:
    """A worker loop's event (engine thread): a request's final engine output."""

    output: EngineOutput


@dataclass(frozen=True)
class StopLoop:
    """A worker loop's event: stop (shutdown)."""
