"""Conditional disaggregation: a decode instance prefills a prompt itself when the part of it
not in its prefix cache is at most ``local_prefill_max_tokens`` tokens, else asks a prefill
instance. Real server (1 prefill, 2 decode models configured differently), real NIXL."""

from __future__ import annotations

import time

import pytest

from backend.client import stream_generate
from tests.conftest import deployment_server, hf_greedy, metric_values, wait_pool_free

SHORT = "Name three colours."
LONG = "Summarise this list: " + " ".join(f"entry {i} is worth {i * 7} points;" for i in range(25))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with deployment_server(
        tmp_path_factory,
        "conditional",
        mode="disagg",
        model_path=str(model_dir),
        prefill_instances=1,
        decode_instances=2,
        overrides={"kv_cache_tokens": "4096", "num_threads": "1"},
        per_model={"decode_0": {"local_prefill_max_tokens": "64"}, "decode_1": {"local_prefill_max_tokens": "0"}},
    ) as server:
        yield server


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()


def _paths(url: str, model: str) -> tuple[float, float]:
    time.sleep(0.6)  # the metrics refresh every 0.25 s
    local = sum(metric_values(url, "triton_disagg_prefill_local_total", model=model))
    remote = sum(metric_values(url, "triton_disagg_prefill_remote_total", model=model))
    return local, remote


def test_the_local_or_remote_choice_follows_the_configuration(server, tokenizer, hf_model):
    url = server.metrics_url
    assert len(tokenizer.encode(SHORT)) < 64 < len(tokenizer.encode(LONG))
    cases = [("decode_0", SHORT, (1, 0)), ("decode_0", LONG, (0, 1)), ("decode_1", SHORT, (0, 1))]
    for model, prompt, (d_local, d_remote) in cases:
        before = _paths(url, model)
        res = stream_generate(server.grpc_url, prompt, 8, model=model, temperature=0.0, ignore_eos=True)
        assert res.error is None, res.error
        assert res.token_ids == hf_greedy(hf_model, tokenizer(prompt)["input_ids"], 8), (model, prompt[:20])
        after = _paths(url, model)
        assert (after[0] - before[0], after[1] - before[1]) == (d_local, d_remote), (model, prompt[:20])
    for model in ("prefill_0", "decode_0", "decode_1"):
        wait_pool_free(url, model)
