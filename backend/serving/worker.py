"""The worker behind a model instance, as the Triton layer sees it (:class:`Worker`), and what
every worker shares (building the engine, turning a client request into sampling parameters,
handing engine outputs to the session, the KV-pool gauges)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from backend.engine.cache_summary import CacheSummary
from backend.engine.outputs import EngineOutput
from backend.engine.protocol import Engine
from backend.engine.sampling_params import SamplingParams
from backend.parallel.engine_factory import build_engine
from backend.serving.config import InstanceConfig, ServingConfig
from backend.serving.session import GenerationSession
from backend.serving.stats import InstanceStats


class Worker(Protocol):
    """``submit`` a session (answered through the session), ``cancel`` one; ``stats`` feeds the
    metrics; ``observations`` hands over (and forgets) the latencies measured since the last
    call, by histogram name; ``health`` says why the worker cannot serve now (None: it can);
    ``cache_summary`` what it caches and how loaded it is."""

    max_model_len: int
    vocab_size: int

    def describe(self) -> str: ...
    def submit(self, session: GenerationSession) -> None: ...
    def cancel(self, req_id: str) -> None: ...
    def stats(self) -> InstanceStats: ...
    def observations(self) -> dict[str, list[float]]: ...
    def health(self) -> str | None: ...
    def cache_summary(self) -> CacheSummary:
        """Its prefix cache and load, for the front's KV-aware routing."""

    def leave(self, final: bool) -> None:
        """Draining: tell the membership this instance takes nothing new (``final``: leave it)."""

    def member_name(self) -> str | None:
        """This instance's name in the deployment's membership (None: it is not registered)."""

    def shutdown(self) -> None: ...


def start_engine(config: InstanceConfig) -> Engine:
    """Pin the process (``cpu_affinity``), then build this instance's engine."""
    config.serving.apply_cpu_affinity()
    return build_engine(config.engine)


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
    )


def deliver(session: GenerationSession, out: EngineOutput) -> None:
    """Hand one engine output to the session (engine loop thread)."""
    session.on_output(
        out.new_token_ids,
        out.finished,
        out.finish_reason,
        out.error,
        out.error_kind,
        logprobs=out.logprobs,
        prompt_logprobs=out.prompt_logprobs,
    )


@dataclass(frozen=True)
class EngineDone:
    """A worker loop's event (engine thread): a request's final engine output."""

    output: EngineOutput


@dataclass(frozen=True)
class StopLoop:
    """A worker loop's event: stop (shutdown)."""
