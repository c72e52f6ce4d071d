"""Prefix caching through real servers: a conversation's follow-up turn (the whole history
resent) finds its prefix in the cache, on the aggregated model and on the prefill instances of a
disaggregated deployment, and greedy output still equals transformers'."""

from __future__ import annotations

import threading
import time

from backend.client import stream_generate
from tests.conftest import hf_greedy, metric_values, wait_pool_free

SYSTEM = "You are a helpful assistant. " + " ".join(f"Rule {i}: answer briefly and politely." for i in range(12))


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


def _bytes(url: str, model: str) -> float:
    return sum(metric_values(url, "triton_disagg_kv_transfer_bytes_total", model=model))


def _settled(read, timeout_s=5.0):
    """A metric read once it stopped moving (the gauges refresh every 0.25 s)."""
    deadline, last = time.monotonic() + timeout_s, read()
    while time.monotonic() < deadline:
        time.sleep(0.6)
        now = read()
        if now == last:
            return now
        last = now
    return last


def _aligned(tokenizer, text: str, page: int = 16) -> str:
    """``text`` cut so that all its tokens but the last fill whole pages (the decode side can then
    hold everything the prefill would send)."""
    words = text.split(" ")
    while True:
        candidate = " ".join(words)
        n = len(tokenizer.encode(candidate, add_special_tokens=False))
        if (n - 1) % page == 0:
            return candidate
        words = words[:-1]


def test_decode_asks_only_for_the_pages_it_lacks(disagg_server, tokenizer, hf_model):
    """Turn 2 of a conversation on the same decode instance: its cache holds turn 1's pages, the
    prefill instance is asked for the rest and sends only those; a prompt the decode instance
    holds completely (but its last token) needs no prefill instance at all."""
    url, grpc = disagg_server.metrics_url, disagg_server.grpc_url
    system = "You answer questions about geography. " + " ".join(f"Fact {i}: rivers flow downhill." for i in range(14))
    first = _aligned(tokenizer, system + " Question: what is the capital of Spain? Answer:")
    second = first + " Madrid. Question: and of Portugal? Answer:"
    prefills = ("prefill_0", "prefill_1")
    sent = lambda: sum(_bytes(url, m) for m in prefills)  # noqa: E731
    hits = lambda: _hits(url, "decode_0")  # noqa: E731
    local = lambda: sum(metric_values(url, "triton_disagg_prefill_local_total", model="decode_0"))  # noqa: E731

    b0 = _settled(sent)
    r1 = stream_generate(grpc, first, 6, model="decode_0", temperature=0.0, ignore_eos=True)
    b1, h1 = _settled(sent), _settled(hits)
    n1 = len(tokenizer.encode(first, add_special_tokens=False))
    per_page = (b1 - b0) / ((n1 - 1) // 16)  # turn 1 crossed the fabric whole
    assert r1.error is None and per_page > 0

    r2 = stream_generate(grpc, second, 6, model="decode_0", temperature=0.0, ignore_eos=True)
    b2, h2 = _settled(sent), _settled(hits)
    n2 = len(tokenizer.encode(second, add_special_tokens=False))
    cached_pages = (h2 - h1) // 16
    assert cached_pages >= (n1 - 1) // 16 - 1, (h1, h2)  # turn 1's pages were found on the decode side
    assert b2 - b1 == per_page * (-(-(n2 - 1) // 16) - cached_pages)  # only the missing pages were sent
    assert b2 - b1 < (b1 - b0)
    assert r2.error is None and r2.token_ids == hf_greedy(hf_model, tokenizer(second)["input_ids"], 6)

    l0 = _settled(local)
    r3 = stream_generate(grpc, first, 6, model="decode_0", temperature=0.0, ignore_eos=True)
    assert r3.error is None and r3.token_ids == r1.token_ids == hf_greedy(hf_model, tokenizer(first)["input_ids"], 6)
    assert _settled(local) == l0 + 1 and _settled(sent) == b2  # turn 1 again: nothing crossed the fabric
    for m in (*prefills, "decode_0", "decode_1"):
        wait_pool_free(url, m)


def test_cancel_mid_transfer_of_a_shared_prefix(disagg_server, tokenizer, hf_model):
    """Two requests share a cached prefix on decode_0 and a prefill instance; one is cancelled
    by its client while its prefill streams KV. The other completes, every pool returns to free,
    and later requests on that prefix still give transformers' output (no page of the shared
    prefix was freed under a holder or left half-written in the cache)."""
    url, grpc = disagg_server.metrics_url, disagg_server.grpc_url
    shared = "You are a careful reader. " + " ".join(f"Clause {i}: keep every promise." for i in range(16))
    warm = shared + " Question: what is clause 3? Answer:"
    long_tail = shared + " Now restate each of these: " + " ".join(f"item {i}" for i in range(400))
    short = shared + " Question: what is clause 5? Answer:"
    assert stream_generate(grpc, warm, 4, model="decode_0", temperature=0.0, ignore_eos=True).error is None

    results = {}

    def run(name, prompt, **kw):
        results[name] = stream_generate(grpc, prompt, 8, model="decode_0", temperature=0.0, ignore_eos=True, **kw)

    threads = [
        threading.Thread(target=run, args=("cancelled", long_tail), kwargs={"cancel_after_s": 0.5}),
        threading.Thread(target=run, args=("kept", short)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not results["cancelled"].token_ids, "the prefill should still have been running at the cancel"
    assert results["kept"].error is None, results["kept"].error
    assert results["kept"].token_ids == hf_greedy(hf_model, tokenizer(short)["input_ids"], 8)
    for m in ("prefill_0", "prefill_1", "decode_0"):
        wait_pool_free(url, m, timeout_s=30)

    h0 = _hits(url, "decode_0")
    again = stream_generate(grpc, short, 8, model="decode_0", temperature=0.0, ignore_eos=True)
    medium = shared + " Now restate each of these: " + " ".join(f"item {i}" for i in range(30))
    other = stream_generate(grpc, medium, 8, model="decode_0", temperature=0.0, ignore_eos=True)
    assert again.error is None and other.error is None
    assert again.token_ids == results["kept"].token_ids
    assert other.token_ids == hf_greedy(hf_model, tokenizer(medium)["input_ids"], 8)
    assert _wait_hits(url, "decode_0", h0) > h0  # the shared prefix is still cached and reused
    for m in ("prefill_0", "prefill_1", "decode_0"):
        wait_pool_free(url, m)
