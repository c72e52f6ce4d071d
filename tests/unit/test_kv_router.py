"""The KV-aware router on hand-made cache summaries, and the summaries themselves: what an
instance publishes matches what its page allocator caches, and survives the wire."""

from __future__ import annotations

import time

import pytest

from backend.engine.cache_summary import CacheSummary
from backend.engine.page_allocator import PageAllocator
from backend.serving.kv_router import KVRouter

PS = 4
SALT = b"model|float32|tp1|ps4"


def _summary_of(prompts: list[list[int]], free_pages: int = 64) -> CacheSummary:
    """What an instance that computed ``prompts`` publishes (through its real allocator)."""
    alloc = PageAllocator(64, PS, prefix_caching=True, salt=SALT)
    for i, ids in enumerate(prompts):
        alloc.allocate(f"r{i}", len(ids), token_ids=ids)
        alloc.register(f"r{i}", ids, len(ids))
        alloc.free(f"r{i}")
    version, keys = alloc.cached_keys()
    return CacheSummary(SALT.hex(), PS, version, keys, 64, free_pages, 0, 0)


PREFIX = list(range(100, 124))  # 6 pages


def test_summary_round_trips_and_rejects_bad_input():
    s = _summary_of([PREFIX])
    assert len(s.keys) == 6 and s.version == 6
    assert CacheSummary.from_json(s.to_json()) == s
    bad = {**s.to_json(), "keys": "abc"}
    with pytest.raises(ValueError, match="keys"):
        CacheSummary.from_json(bad)
    with pytest.raises(ValueError, match="unknown fields"):
        CacheSummary.from_json({**s.to_json(), "extra": 1})
    with pytest.raises(ValueError, match="free_pages"):
        CacheSummary.from_json({**s.to_json(), "free_pages": -1})


def test_version_changes_when_the_cached_set_does():
    alloc = PageAllocator(2, PS, prefix_caching=True, salt=SALT)
    v0, _ = alloc.cached_keys()
    alloc.allocate("a", 8, token_ids=list(range(8)))
    alloc.register("a", list(range(8)), 8)
    alloc.free("a")
    v1, keys = alloc.cached_keys()
    assert v1 > v0 and len(keys) == 2
    alloc.allocate("b", 4, token_ids=[9, 9, 9, 9])  # evicts a cached page
    v2, keys = alloc.cached_keys()
    assert v2 > v1 and len(keys) == 1


def test_routes_to_the_instance_holding_the_prefix():
    router = KVRouter()
    router.update("a", _summary_of([list(range(24))]))
    router.update("b", _summary_of([PREFIX]))
    prompt = PREFIX + [7, 8, 9, 10, 11]
    assert router.cached_tokens("b", prompt) == 24 and router.cached_tokens("a", prompt) == 0
    for i in range(4):  # whatever the round-robin start
        assert router.pick(("q", i), prompt, ["a", "b"], 10) == "b"
        router.done("b", ("q", i))
    # the first pick predicts its new full page cached on b too: 24 tokens, then 28
    assert router.counters == {"query_tokens": 4 * len(prompt), "predicted_hit_tokens": 24 + 3 * 28}


def test_load_outweighs_a_small_overlap():
    router = KVRouter(overlap_weight=1.0)
    router.update("a", _summary_of([PREFIX[:4]]))  # one page of the prompt
    router.update("b", _summary_of([]))
    router.pick("busy", list(range(500, 540)), ["a"], 20)  # 20 pages in flight on a
    assert router.pick("q", PREFIX + [1, 2], ["a", "b"], 8) == "b"
    router.done("a", "busy")
    assert router.pick("q2", PREFIX + [1, 2], ["a", "b"], 8) == "a"


def test_an_instance_short_of_pages_goes_last():
    router = KVRouter()
    router.update("a", _summary_of([PREFIX], free_pages=2))
    router.update("b", _summary_of([]))
    assert router.pick("q", PREFIX + [1], ["a", "b"], 10) == "b"


def test_least_loaded_when_weight_is_zero_and_round_robin_on_ties():
    router = KVRouter(overlap_weight=0.0)
    router.update("a", _summary_of([PREFIX]))
    picks = [router.pick(i, PREFIX + [1], ["a", "b"], 1) for i in range(2)]
    assert sorted(picks) == ["a", "b"]  # one each: the in-flight count breaks the tie
    for i, name in enumerate(picks):
        router.done(name, i)
    assert {router.pick(10 + i, [1, 2, 3], ["a", "b"], 1) for i in range(2)} == {"a", "b"}


def test_a_routed_prompt_counts_as_cached_there_until_its_ttl():
    router = KVRouter(predict_ttl_s=0.3)
    router.update("a", _summary_of([]))
    router.update("b", _summary_of([]))
    prompt = PREFIX + [1]
    first = router.pick("q1", prompt, ["a", "b"], 1)
    router.done(first, "q1")
    assert router.cached_tokens(first, prompt) == 24
    assert router.pick("q2", prompt, ["a", "b"], 1) == first  # a burst sharing a prefix stays together
    router.done(first, "q2")
    time.sleep(0.35)
    assert router.cached_tokens(first, prompt) == 0  # never confirmed by a summary: forgotten
    router.update(first, _summary_of([prompt]))  # confirmed
    assert router.cached_tokens(first, prompt) == 24
    router.forget(first)
    assert router.cached_tokens(first, prompt) == 0


def test_no_candidates():
    assert KVRouter().pick("q", [1, 2], [], 1) is None


def test_a_cache_salt_matches_only_pages_cached_under_it():
    """The router hashes a prompt from its ``cache_salt`` as the allocator does: another tenant's
    pages are no hit, the same tenant's are."""
    alloc = PageAllocator(64, PS, prefix_caching=True, salt=SALT)
    alloc.allocate("t", len(PREFIX), token_ids=PREFIX, cache_salt="tenant-a")
    alloc.register("t", PREFIX, len(PREFIX))
    alloc.free("t")
    version, keys = alloc.cached_keys()
    router = KVRouter()
    router.update("a", CacheSummary(SALT.hex(), PS, version, keys, 64, 64, 0, 0))
    router.update("b", _summary_of([PREFIX]))  # the same text, no salt
    assert router.cached_tokens("a", PREFIX + [1], "tenant-a") == len(PREFIX)
    assert router.cached_tokens("a", PREFIX + [1]) == 0 and router.cached_tokens("a", PREFIX + [1], "other") == 0
    assert router.cached_tokens("b", PREFIX + [1], "tenant-a") == 0
    assert router.pick("r1", PREFIX + [1], ["b", "a"], 7, "tenant-a") == "a"
    assert router.pick("r2", PREFIX + [1], ["a", "b"], 7) == "b"


def test_pages_in_an_instances_tiers_count_as_nearly_cached():
    """A prompt whose pages are in an instance's host or disk tier (``tier_keys``) goes there
    rather than to an instance without them; one holding them in its pool still wins."""
    pool = _summary_of([PREFIX])
    tiers = CacheSummary(SALT.hex(), PS, 1, frozenset(), 64, 64, 0, 0, pool.keys)
    assert CacheSummary.from_json(tiers.to_json()) == tiers
    assert len(CacheSummary.from_json(tiers.to_json(max_keys=2)).tier_keys) == 2
    router = KVRouter()
    router.update("none", _summary_of([[7] * 24]))
    router.update("tiers", tiers)
    assert router.cached_tokens("tiers", PREFIX + [1]) == len(PREFIX)
    assert router.pick("r1", PREFIX + [1], ["none", "tiers"], 7) == "tiers"
    router.done("tiers", "r1")
    router.update("pool", pool)
    assert router.pick("r2", PREFIX + [1], ["tiers", "pool"], 7) == "pool"
