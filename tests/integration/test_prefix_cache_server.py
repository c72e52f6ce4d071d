"""Prefix caching through real servers: a conversation's follow-up turn (the whole history
resent) finds its prefix in the cache, on the aggregated model and on the prefill instances of a
disaggregated deployment, and greedy output still equals transformers'."""

from __future__ import annotations

import time

import pytest

from backend.client import stream_generate
from tests.conftest import hf_greedy, metric_values, wait_pool_free

SYSTEM = "You are a helpful assistant. " + " ".join(f"Rule {i}: answer briefly and politely." for i in range(12))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()


def _hits(url: str, model: str) -> float:
    return sum(metric_values(url, "triton_disagg_prefix_cache_hit_tokens_total", model=model))


def _turns(tokenizer):
    first = SYSTEM + "\nUser: What is the capital of France?\nAssistant:"
    return first, first + " Paris.\nUser: And of Italy?\nAssistant:"


def _wait_hits(url, model, above, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while _hits(url, model) <= above and time.monotonic() < deadline:
        time.sleep(0.1)  # the gauges refresh every 0.25 s
    return _hits(url, model)


def test_follow_up_turn_hits_the_cache_aggregated(aggregated_server, tokenizer, hf_model):
    url = aggregated_server.metrics_url
    first, second = _turns(tokenizer)
    before = _hits(url, "llm")
    r1 = stream_generate(aggregated_server.grpc_url, first, 8, temperature=0.0, ignore_eos=True)
    assert r1.error is None
    mid = _wait_hits(url, "llm", before - 1)
    r2 = stream_generate(aggregated_server.grpc_url, second, 8, temperature=0.0, ignore_eos=True)
    assert r2.error is None
    n_first = len(tokenizer(first)["input_ids"])
    after = _wait_hits(url, "llm", mid)
    assert after - mid >= (n_first // 16 - 1) * 16, (before, mid, after)  # nearly all of turn 1 reused
    assert r2.token_ids == hf_greedy(hf_model, tokenizer(second)["input_ids"], 8)
    wait_pool_free(url, "llm")


def test_prefill_instances_reuse_the_prefix_disaggregated(disagg_server, tokenizer, hf_model):
    url = disagg_server.metrics_url
    first, second = _turns(tokenizer)
    prefills = ("prefill_0", "prefill_1")
    before = sum(_hits(url, m) for m in prefills)
    outs = [
        stream_generate(disagg_server.grpc_url, p, 8, temperature=0.0, ignore_eos=True) for p in (first, first, second)
    ]
    assert all(o.error is None for o in outs)
    deadline = time.monotonic() + 5
    while sum(_hits(url, m) for m in prefills) <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sum(_hits(url, m) for m in prefills) > before  # a prefill instance found turn 1's pages
    assert outs[0].token_ids == outs[1].token_ids == hf_greedy(hf_model, tokenizer(first)["input_ids"], 8)
    assert outs[2].token_ids == hf_greedy(hf_model, tokenizer(second)["input_ids"], 8)
    for m in (*prefills, "decode_0", "decode_1"):
        wait_pool_free(url, m)
