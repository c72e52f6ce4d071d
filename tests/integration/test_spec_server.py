"""Speculative decoding and structured output through a real tritonserver: the disaggregated
front ``llm`` (prefill -> KV over NIXL -> decode, which owns sampling) and ``llm_aggregated``."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from backend.client import stream_generate
from tests.conftest import DISAGG_MODELS, PROMPTS, wait_pool_free
from tests.schema_check import PROMPTS as SCHEMA_PROMPTS
from tests.schema_check import SCHEMAS, violations

N_TOKENS = 16


@pytest.fixture(autouse=True)
def pools_back_to_free(disagg_server):
    yield
    live = disagg_server.instance_pids()  # a fault test of the shared server may have killed one
    for model in DISAGG_MODELS:
        if f"{model}_0_0" in live:
            wait_pool_free(disagg_server.metrics_url, model, timeout_s=30)


def spec_inputs(k: int | None = None, method: str | None = None, guided_json: str | None = None) -> dict:
    extra = {}
    if k is not None:
        extra["num_draft_tokens"] = (np.array([k], dtype=np.int32), "INT32")
    if method is not None:
        extra["draft_method"] = (np.array([method.encode()], dtype=object), "BYTES")
    if guided_json is not None:
        extra["guided_json"] = (np.array([guided_json.encode()], dtype=object), "BYTES")
    return extra


def concurrently(url, jobs):
    """jobs: list of (prompt, max_tokens, model, kwargs); run all at once."""
    out = [None] * len(jobs)

    def run(i):
        prompt, n, model, kw = jobs[i]
        out[i] = stream_generate(url, prompt, n, model=model, **kw)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    [t.start() for t in threads]
    [t.join(300) for t in threads]
    return out


def test_greedy_identical_with_speculation_disagg_and_aggregated(disagg_server):
    url = disagg_server.grpc_url
    plain = concurrently(url, [(p, N_TOKENS, "llm", {"ignore_eos": True, "extra": spec_inputs(0)}) for p in PROMPTS])
    assert all(r.error is None for r in plain), [r.error for r in plain]
    reference = [r.token_ids for r in plain]
    for model, method in (
        ("llm", "lookup"),
        ("llm", "hidden"),
        ("llm_aggregated", "lookup"),
        ("llm_aggregated", "hidden"),
    ):
        spec = concurrently(
            url, [(p, N_TOKENS, model, {"ignore_eos": True, "extra": spec_inputs(4, method)}) for p in PROMPTS]
        )  # 8 requests in flight, different acceptances
        assert [r.error for r in spec] == [None] * len(PROMPTS)
        assert [r.token_ids for r in spec] == reference, (model, method)
        assert all(r.finish_reason == "length" for r in spec)


def test_json_schemas_through_the_disaggregated_path(disagg_server):
    jobs = [
        (text, 96, "llm", {"chat": True, "extra": spec_inputs(3, guided_json=json.dumps(schema))})
        for schema, text in zip(SCHEMAS, SCHEMA_PROMPTS)
    ]
    results = concurrently(disagg_server.grpc_url, jobs)
    for schema, res in zip(SCHEMAS, results):
        assert res.error is None, res.error
        assert res.finish_reason == "stop", res.text
        assert violations(json.loads(res.text), schema) == [], res.text


def test_invalid_schema_is_a_clear_error_and_the_server_keeps_serving(disagg_server):
    url = disagg_server.grpc_url
    bad = stream_generate(url, "hi", 8, model="llm", extra=spec_inputs(guided_json='{"type": "object",'))
    assert bad.error and "invalid guided_json schema" in bad.error, bad.error
    bad_k = stream_generate(url, "hi", 8, model="llm", extra=spec_inputs(99))
    assert bad_k.error and "num_draft_tokens" in bad_k.error, bad_k.error
    ok = stream_generate(url, "What is the capital of France?", 8, model="llm", chat=True)
    assert ok.error is None and len(ok.token_ids) > 0
