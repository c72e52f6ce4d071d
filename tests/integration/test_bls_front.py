"""The front model where its server's own gRPC address is unknown (a repository started without
the launcher's ``TRITON_DISAGG_GRPC_URL``): it reaches its server's decode models by BLS (taken
as ready: this Triton's BLS ``is_model_ready`` crashes a stub that calls it from a thread),
reads what they say of themselves (health, cache summary) in their membership records, and
cancels a request through the one control input left on the decode model
(``cancel_request_id``: BLS calls cannot be cancelled), which frees the decode and prefill
instances' pages. Greedy output equals transformers'."""

from __future__ import annotations

import time

import pytest

from backend.client import stream_generate
from backend.serving.discovery import GRPC_URL_ENV
from tests.conftest import deployment_server, hf_greedy, metric_values, wait_pool_free

MODELS = ("decode_0", "decode_1", "prefill_0")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with deployment_server(
        tmp_path_factory,
        "bls-front",
        mode="disagg",
        model_path=str(model_dir),
        prefill_instances=1,
        decode_instances=2,
        overrides={"kv_cache_tokens": "4096", "num_threads": "1"},
        per_model={"front": {"decode_models": "decode_0,decode_1"}},
        extra_env={GRPC_URL_ENV: ""},  # no address: BLS, and records without one
    ) as s:
        yield s


def test_a_front_without_its_address_routes_by_bls_and_cancels_through_the_control_input(server, hf_model, tokenizer):
    url = server.metrics_url
    deadline = time.monotonic() + 30  # both serving by their records
    while sorted(metric_values(url, "triton_disagg_decode_target_up", model="llm")) != [1.0, 1.0]:
        assert time.monotonic() < deadline, metric_values(url, "triton_disagg_decode_target_up", model="llm")
        time.sleep(0.25)
    for prompt in ("What is the capital of France?", "List three fruits:"):
        res = stream_generate(server.grpc_url, prompt, 8, model="llm", temperature=0.0, ignore_eos=True)
        assert res.error is None, res.error
        assert res.token_ids == hf_greedy(hf_model, tokenizer(prompt)["input_ids"], 8)

    res = stream_generate(server.grpc_url, "Count slowly:", 200, model="llm", ignore_eos=True, cancel_after_s=1.5)
    assert 0 < len(res.token_ids) < 200, len(res.token_ids)  # cancelled mid-stream
    for m in MODELS:
        wait_pool_free(url, m, timeout_s=30)
    deadline = time.monotonic() + 30
    while sum(metric_values(url, "triton_disagg_requests_active", model="llm")) != 0:
        assert time.monotonic() < deadline, "the front model still counts the cancelled request"
        time.sleep(0.2)
