"""Conditional disaggregation: a decode instance prefills a prompt itself when the part of it
not in its prefix cache is at most ``local_prefill_max_tokens`` tokens, or when every prefill
instance has ``local_prefill_queue_bound`` requests outstanding; else it asks a prefill
instance. Real server (1 prefill, 2 decode models configured differently), real NIXL."""

from __future__ import annotations

import threading
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
        per_model={
            "decode_0": {"local_prefill_max_tokens": "64"},
            "decode_1": {"local_prefill_max_tokens": "0", "local_prefill_queue_bound": "1"},
        },
    ) as server:
        yield server


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


def test_a_busy_prefill_instance_sends_prefills_home(server, tokenizer, hf_model):
    """decode_1 never prefills by length, but with one request outstanding on its only prefill
    instance (the bound is 1) the next prompt is prefilled on decode_1 itself."""
    url = server.metrics_url
    huge = "Read all of this: " + " ".join(f"line {i} says {i * 11}." for i in range(330))
    assert len(tokenizer.encode(huge)) > 2000
    before = _paths(url, "decode_1")
    busy = {}
    t = threading.Thread(
        target=lambda: busy.update(r=stream_generate(server.grpc_url, huge, 2, model="decode_1", ignore_eos=True))
    )
    t.start()
    time.sleep(1.0)  # its prefill runs on prefill_0 for seconds
    res = stream_generate(server.grpc_url, SHORT, 8, model="decode_1", temperature=0.0, ignore_eos=True)
    t.join(timeout=120)
    assert res.error is None and busy["r"].error is None, (res.error, busy["r"].error)
    assert res.token_ids == hf_greedy(hf_model, tokenizer(SHORT)["input_ids"], 8)
    after = _paths(url, "decode_1")
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)  # the short one here, the long one remote
    for model in ("prefill_0", "decode_1"):
        wait_pool_free(url, model)
