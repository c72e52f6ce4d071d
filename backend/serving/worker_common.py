"""What every worker (aggregated, prefill, decode) shares: building its engine from the model's
Triton parameters, turning a client request into sampling parameters, handing engine outputs
to the session, and the KV-pool gauges."""
from __future__ import annotations

import os

from backend.engine.llm_engine import EngineOutput, LLMEngine
from backend.parallel.engine_factory import build_engine as build_engine_for
from backend.engine.config import EngineConfig
from backend.serving.session import GenerationSession
from backend.engine.sampling.params import SamplingParams

DEFAULT_DRAFT_METHOD = "lookup"
ENGINE_KEYS = ("device", "dtype", "page_size", "kv_cache_tokens", "num_pages", "max_num_seqs",
               "max_num_batched_tokens", "max_model_len", "num_threads", "max_tokens_limit",
               "tensor_parallel_size")


def apply_cpu_affinity(params: dict) -> None:
    """Pin this instance's process to the cores in ``cpu_affinity`` ("0", "0,1", "2-3"), if set."""
    spec = (params.get("cpu_affinity") or "").strip()
    if not spec:
        return
    cores = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    os.sched_setaffinity(0, cores)


def engine_config(model_path: str, params: dict) -> EngineConfig:
    """EngineConfig from a model's (string) Triton parameters; other keys belong to the serving layer."""
    return EngineConfig.from_dict({"model_path": model_path,
                                   **{k: v for k, v in params.items() if k in ENGINE_KEYS}})


def speculation_defaults(params: dict) -> tuple[int, str]:
    """(num_draft_tokens, draft_method) for requests that do not set them: model parameters
    ``speculative_k`` (0 = off) and ``draft_method``."""
    k = int(params.get("speculative_k", "0") or 0)
    method = (params.get("draft_method") or DEFAULT_DRAFT_METHOD).strip()
    SamplingParams(num_draft_tokens=k, draft_method=method)   # validates both
    return k, method


def build_engine(model_path: str, params: dict) -> tuple[EngineConfig, LLMEngine]:
    """Pin the process (``cpu_affinity``), then build this instance's engine."""
    apply_cpu_affinity(params)
    config = engine_config(model_path, params)
    return config, build_engine_for(config)


def sampling_params(session: GenerationSession, defaults: tuple[int, str] = (0, DEFAULT_DRAFT_METHOD)) -> SamplingParams:
    r = session.request
    k = defaults[0] if r.num_draft_tokens is None else r.num_draft_tokens
    return SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, top_k=r.top_k,
                          top_p=r.top_p, seed=r.seed, end_ids=(r.end_id,) if r.end_id is not None else (),
                          ignore_eos=r.ignore_eos, num_draft_tokens=k,
                          draft_method=r.draft_method or defaults[1], grammar=r.grammar)


def deliver(session: GenerationSession, out: EngineOutput) -> None:
    """Hand one engine output to the session (engine loop thread)."""
    session.on_output(out.new_token_ids, out.finished, out.finish_reason, out.error)


def pool_gauges(pool: dict) -> dict:
    return {"kv_pages_total": pool["total"], "kv_pages_free": pool["free"], "kv_pages_used": pool["used"]}
