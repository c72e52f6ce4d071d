"""Prefix caching: the page allocator's cache (hash chain, reference counts, LRU eviction, only
full computed pages shared) and the engine using it (greedy outputs equal with and without it,
shared pages never freed while held, pools back to free after aborts)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TINY_VOCAB, assert_pool_idle, build_tiny_llama, make_engine, run_to_completion, tokens_of

from backend.engine.page_allocator import PageAllocator, PoolFullError, page_hashes
from backend.engine.sampling_params import SamplingParams

PS = 4


def test_hash_chain_depends_on_the_whole_prefix_and_the_salt():
    a = page_hashes(list(range(12)), PS, b"m")
    assert len(a) == 3 and len(set(a)) == 3
    assert page_hashes(list(range(13)), PS, b"m") == a  # the partial page is not hashed
    b = page_hashes([99, *range(1, 12)], PS, b"m")
    assert b[0] != a[0] and b[1] != a[1]  # a change in page 0 changes every later hash
    assert page_hashes(list(range(12)), PS, b"other")[0] != a[0]
    assert page_hashes(list(range(12)), PS, b"m", first=1, prev=a[0]) == a[1:]


def test_attach_register_release_and_lru_eviction():
    alloc = PageAllocator(8, PS, prefix_caching=True, salt=b"t")
    prompt = list(range(10))  # 2 full pages + 2 tokens
    t1 = alloc.allocate("a", len(prompt), token_ids=prompt)
    assert alloc.cached_tokens("a") == 0 and len(t1) == 3
    alloc.register("a", prompt, 10)  # the engine computed all 10 tokens: pages 0 and 1 are full
    assert alloc.stats()["cached"] == 2
    t2 = alloc.allocate("b", len(prompt), token_ids=prompt)
    assert t2[:2] == t1[:2] and t2[2] != t1[2] and alloc.cached_tokens("b") == 8  # partial page private
    alloc.free("a")
    assert alloc.stats()["free"] == 8 - 3  # b holds its 3 pages; a's private page is free
    alloc.free("b")
    s = alloc.stats()
    assert s["free"] == 8 and s["cached"] == 2 and s["used"] == 0  # cached pages count as free
    # a prompt that is exactly two pages: the last token is always computed, so one page is attached
    alloc.allocate("c", 8, token_ids=prompt[:8])
    assert alloc.cached_tokens("c") == 4
    alloc.free("c")
    # pool pressure: 8 fresh pages needed; the free list runs out, then cached pages are evicted (LRU)
    alloc.allocate("d", 32)
    s = alloc.stats()
    assert s["cached"] == 0 and s["prefix_evictions"] == 2 and s["free"] == 0
    alloc.free("d")
    alloc.allocate("e", 10, token_ids=prompt)
    assert alloc.cached_tokens("e") == 0  # evicted: no hit


def test_held_pages_are_never_evicted_and_commitments_hold():
    alloc = PageAllocator(8, PS, prefix_caching=True)
    prompt = list(range(9))
    alloc.allocate("a", 9, token_ids=prompt)
    alloc.register("a", prompt, 9)
    alloc.allocate("b", 9, token_ids=prompt)  # shares pages 0-1 with a
    with pytest.raises(PoolFullError):
        alloc.allocate("c", 12)  # commitments count the shared pages per holder: 3 + 3 + 3 > 8
    alloc.free("a")
    held = set(alloc.page_table("b"))
    alloc.allocate("c", 4)  # 1 page: from the free list, never one of b's
    assert not held & set(alloc.page_table("c"))
    alloc.free("b")
    alloc.free("c")
    assert alloc.stats()["free"] == 8


def test_a_duplicate_page_stays_private_and_off_turns_it_all_off():
    alloc = PageAllocator(8, PS, prefix_caching=True)
    prompt = list(range(8))
    alloc.allocate("a", 8)
    alloc.allocate("b", 8)  # computed twice at once (no token_ids: no attach)
    alloc.register("a", prompt, 8)
    alloc.register("b", prompt, 8)
    assert alloc.stats()["cached"] == 2  # b's copies are not registered
    alloc.free("b")
    assert alloc.stats()["free"] == 6  # b's pages went back to the free list
    off = PageAllocator(8, PS)
    off.allocate("a", 8, token_ids=prompt)
    off.register("a", prompt, 8)
    off.free("a")
    off.allocate("b", 8, token_ids=prompt)
    assert off.stats()["cached"] == 0 and off.cached_tokens("b") == 0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-prefix"))


def _prompts():
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, TINY_VOCAB, (45,), generator=g).tolist()  # shared "system prompt"
    return [system + torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (3, 11, 20)]


def test_engine_outputs_equal_with_and_without_caching_and_the_cache_hits(tiny_dir):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = _prompts()
    outputs = {}
    for caching in (False, True):
        engine = make_engine(tiny_dir, page_size=PS, enable_prefix_caching=caching)
        got = []
        engine.add_request("first", prompts[0], params)  # fills the cache with the shared prefix
        got.append(tokens_of(run_to_completion(engine)["first"]))
        for i, p in enumerate(prompts[1:]):  # then concurrent requests sharing it
            engine.add_request(f"r{i}", p, params)
        out = run_to_completion(engine)
        got += [tokens_of(out[f"r{i}"]) for i in range(len(prompts) - 1)]
        outputs[caching] = got
        stats = engine.pool_stats()
        if caching:
            assert stats["prefix_hit_tokens"] >= 2 * (45 // PS) * PS, stats
        else:
            assert stats["prefix_hit_tokens"] == 0 and stats["cached"] == 0
        assert_pool_idle(engine)
    assert outputs[True] == outputs[False]


def test_abort_while_a_shared_prefix_is_held_and_eviction_under_pressure(tiny_dir):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = _prompts()
    engine = make_engine(tiny_dir, page_size=PS, kv_cache_tokens=36 * PS, max_num_batched_tokens=16)
    engine.add_request("warm", prompts[0], params)
    reference = tokens_of(run_to_completion(engine)["warm"])
    engine.add_request("a", prompts[1], params)
    engine.add_request("b", prompts[2], params)
    engine.step()
    engine.step()  # both mid-prefill on the shared cached prefix
    assert engine.abort("a") is not None
    out = run_to_completion(engine)
    assert len(tokens_of(out["b"])) == 6
    assert_pool_idle(engine)
    # unrelated long prompts push every cached page out, then the first prompt runs again
    for i in range(3):
        other = torch.randint(3, TINY_VOCAB, (100,), generator=torch.Generator().manual_seed(50 + i)).tolist()
        engine.add_request(f"o{i}", other, params)
        run_to_completion(engine)
    assert engine.pool_stats()["prefix_evictions"] > 0
    engine.add_request("again", prompts[0], params)
    assert tokens_of(run_to_completion(engine)["again"]) == reference
    assert_pool_idle(engine)
