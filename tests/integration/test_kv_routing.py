"""KV-aware routing through a real server (front -> 2 decode models -> 2 prefill instances, real
NIXL, the real model): a conversation's turns stay on the decode model and the prefill instance
that hold its prefix, and routing learns what an instance caches from the summaries instances
publish (the decode instances' membership records, the prefill instances' cache reports), not
only from its own past choices. Greedy output still equals transformers'."""

from __future__ import annotations

import json
import time

from backend.client import stream_generate
from backend.engine.cache_summary import CacheSummary, page_key
from backend.engine.page_allocator import page_hashes
from backend.launch.drain import members
from tests.conftest import hf_greedy, metric_values, wait_pool_free

DECODES = ("decode_0", "decode_1")  # the front's targets in the disagg_server fixture
PREFILLS = ("prefill_0", "prefill_1")


def _conversation(topic: str, turns: int) -> list[str]:
    """Prompts of one conversation: each resends the whole history (about 150 tokens of its own
    preamble first)."""
    history = f"You are an expert on {topic}. " + " ".join(
        f"Fact {i} about {topic} is worth noting." for i in range(14)
    )
    prompts = []
    for t in range(turns):
        history += f"\nUser: Tell me something new about {topic}, point {t}.\nAssistant:"
        prompts.append(history)
        history += f" Here is point {t} about {topic}."
    return prompts


def _totals(url: str, metric: str, models) -> dict[str, float]:
    return {m: sum(metric_values(url, metric, model=m)) for m in models}


def _served(url: str, metric: str, models, before: dict, timeout_s: float = 5.0) -> list[str]:
    """The models whose ``metric`` grew since ``before`` (waiting for the 0.25 s refresh)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = _totals(url, metric, models)
        grew = [m for m in models if now[m] > before[m]]
        if grew or time.monotonic() > deadline:
            return grew
        time.sleep(0.1)


def _generate(server, prompt: str, model: str = "llm", n: int = 6):
    res = stream_generate(server.grpc_url, prompt, n, model=model, temperature=0.0, ignore_eos=True)
    assert res.error is None, res.error
    return res


def _route(server, prompt: str, model: str = "llm") -> tuple[list[str], list[str]]:
    """Run ``prompt`` on ``model``; which decode model served it, which prefill instance ran it."""
    url = server.metrics_url
    d0 = _totals(url, "triton_disagg_requests_total", DECODES)
    p0 = _totals(url, "triton_disagg_prefix_cache_query_tokens_total", PREFILLS)
    _generate(server, prompt, model)
    decode = _served(url, "triton_disagg_requests_total", DECODES, d0)
    prefill = _served(url, "triton_disagg_prefix_cache_query_tokens_total", PREFILLS, p0)
    return decode, prefill


def test_a_conversation_stays_where_its_prefix_is(disagg_server):
    a, b = _conversation("volcanoes", 3), _conversation("glaciers", 3)
    home = {}
    for name, conv in (("a", a), ("b", b)):
        home[name] = _route(disagg_server, conv[0])
        assert len(home[name][0]) == 1 and len(home[name][1]) == 1, home
    # the follow-up turns alternate between the conversations: a router blind to the cache
    # (least loaded, ties by turns) would send some of them to the other decode model
    for t in (1, 2):
        for name, conv in (("a", a), ("b", b)):
            assert _route(disagg_server, conv[t]) == home[name], (name, t, home)
    for m in DECODES + PREFILLS:
        wait_pool_free(disagg_server.metrics_url, m)


def test_routing_learns_from_published_summaries(disagg_server, tokenizer, hf_model):
    """A prefix computed by a request sent straight to decode_1 (the front never routed it) is
    found by the front through the cache summary in decode_1's membership record; decode_0 finds the prefill
    instance holding it through that instance's cache reports."""
    url = disagg_server.metrics_url
    conv = _conversation("lighthouses", 3)
    decode, (prefill,) = _route(disagg_server, conv[0], model="decode_1")
    assert decode == ["decode_1"]

    ids = tokenizer(conv[0])["input_ids"]
    deadline = time.monotonic() + 10
    while True:  # decode_1's summary lists the pages of the prompt it holds
        summary = _record_state(disagg_server, "decode_1")
        keys = [page_key(h) for h in page_hashes(ids[:-1], summary.page_size, bytes.fromhex(summary.salt))]
        if set(keys) <= summary.keys or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert keys and set(keys) <= summary.keys
    time.sleep(2.0)  # the record (written every 1 s when it changed) has reached the front

    hits = sum(metric_values(url, "triton_disagg_router_predicted_hit_tokens_total", model="llm"))
    assert _route(disagg_server, conv[1]) == (["decode_1"], [prefill])
    time.sleep(0.6)
    routed_hits = sum(metric_values(url, "triton_disagg_router_predicted_hit_tokens_total", model="llm")) - hits
    assert routed_hits >= len(keys) * summary.page_size, routed_hits

    # decode_0 never routed this conversation: only the prefill instances' reports tell it where it is
    before = _totals(url, "triton_disagg_prefix_cache_hit_tokens_total", PREFILLS)
    res = stream_generate(disagg_server.grpc_url, conv[2], 6, model="decode_0", temperature=0.0, ignore_eos=True)
    assert res.error is None, res.error
    assert _served(url, "triton_disagg_prefix_cache_hit_tokens_total", PREFILLS, before) == [prefill]
    assert res.token_ids == hf_greedy(hf_model, tokenizer(conv[2])["input_ids"], 6)
    for m in DECODES + PREFILLS:
        wait_pool_free(url, m)


def _record_state(server, model: str) -> CacheSummary:
    """The cache summary in the membership record of the decode instance serving ``model`` (what
    the front routes by)."""
    records = [r for r in members(server.etcd.url, "default", server.deployment_secret.encode()) if r.model == model]
    assert len(records) == 1 and records[0].role == "decode" and records[0].health == "", records
    return CacheSummary.from_json(json.loads(records[0].cache))
