"""KV tiers below the pool (``kv_tiers.py``, ``host_tier.py``, ``disk_tier.py``) on the tiny model:
a prefix evicted from the pool comes back from the host tier, and from the disk tier in a new
engine (a restart), with greedy outputs equal to an engine without tiers; a damaged block file or
one written for another model or layout is never loaded (the prompt is computed, the output is the
same); a request's ``cache_salt`` keeps its pages from other tenants; a request ended while its
blocks load frees its pages once the load is done. The same with the real model through a real
server: ``tests/integration/test_kv_tiers_e2e.py``."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TINY_VOCAB, assert_pool_idle, build_tiny_llama, make_engine, run_to_completion, tokens_of

from backend.engine.disk_tier import DiskTier
from backend.engine.sampling_params import SamplingParams
from backend.engine.sequence import SeqStatus

PS = 4
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-tiers"))


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, TINY_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CHAT = _tokens(1, 61)  # a conversation's history: 15 full pages
FOLLOW_UP = CHAT + _tokens(2, 9)


def _run(engine, req_id: str, prompt: list[int], params: SamplingParams = PARAMS) -> list[int]:
    engine.add_request(req_id, prompt, params)
    return tokens_of(run_to_completion(engine)[req_id])


def _evict_everything(engine, rounds: int = 3) -> None:
    for i in range(rounds):
        _run(engine, f"other{i}", _tokens(100 + i, 60))


@pytest.fixture(scope="module")
def reference(tiny_dir):
    engine = make_engine(tiny_dir, page_size=PS, enable_prefix_caching=False)
    return {"chat": _run(engine, "c", CHAT), "follow_up": _run(engine, "f", FOLLOW_UP)}


def test_a_prefix_evicted_from_the_pool_comes_back_from_the_host_tier(tiny_dir, reference):
    engine = make_engine(tiny_dir, page_size=PS, kv_cache_tokens=24 * PS, kv_host_tokens=200 * PS)
    assert _run(engine, "c", CHAT) == reference["chat"]
    _evict_everything(engine)
    stats = engine.pool_stats()
    assert stats["prefix_evictions"] > 0 and stats["tier_host_blocks"] > 0, stats
    assert _run(engine, "f", FOLLOW_UP) == reference["follow_up"]
    stats = engine.pool_stats()
    assert stats["prefix_tier_hit_tokens"] >= 15 * PS, stats  # the whole history came from the tier
    assert stats["tier_host_hit_blocks"] >= 15 and stats["tier_load_failures"] == 0, stats
    assert_pool_idle(engine)


def test_without_tiers_an_evicted_prefix_is_computed_again(tiny_dir, reference):
    engine = make_engine(tiny_dir, page_size=PS, kv_cache_tokens=24 * PS, kv_host_tokens=0)
    assert engine.tiers is None
    _run(engine, "c", CHAT)
    _evict_everything(engine)
    assert _run(engine, "f", FOLLOW_UP) == reference["follow_up"]
    assert engine.pool_stats()["prefix_hit_tokens"] == 0


def _disk_engine(tiny_dir, folder, **kw):
    settings = dict(
        page_size=PS,
        kv_cache_tokens=24 * PS,
        kv_host_tokens=0,
        kv_disk_bytes=1 << 30,
        kv_disk_path=str(folder),
        kv_disk_admit_hits=1,
    )
    settings.update(kw)
    return make_engine(tiny_dir, **settings)


def _written_before_a_restart(tiny_dir, folder) -> list:
    """An engine serves the chat twice (its blocks are hit once), then closes: they are on disk."""
    engine = _disk_engine(tiny_dir, folder)
    _run(engine, "c1", CHAT)
    _run(engine, "c2", CHAT)
    engine.close()
    files = sorted(folder.rglob("*.kv"))
    assert len(files) >= 15, files
    return files


def test_a_restarted_engine_serves_the_follow_up_from_the_disk_tier(tiny_dir, reference, tmp_path):
    _written_before_a_restart(tiny_dir, tmp_path)
    engine = _disk_engine(tiny_dir, tmp_path)
    assert _run(engine, "f", FOLLOW_UP) == reference["follow_up"]
    stats = engine.pool_stats()
    assert stats["prefix_tier_hit_tokens"] >= 15 * PS and stats["tier_disk_hit_blocks"] >= 15, stats
    assert stats["tier_disk_corrupt"] == 0
    assert_pool_idle(engine)
    engine.close()


def test_a_damaged_block_file_is_computed_again_and_removed(tiny_dir, reference, tmp_path, caplog):
    files = _written_before_a_restart(tiny_dir, tmp_path)
    engine = _disk_engine(tiny_dir, tmp_path)
    chain = engine.allocator  # the chat's third block: flip one byte of its payload
    from backend.engine.page_allocator import page_hashes

    third = page_hashes(CHAT, PS, chain.salt)[2]
    damaged = next(f for f in files if f.stem == third.hex())
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert _run(engine, "f", FOLLOW_UP) == reference["follow_up"]
    stats = engine.pool_stats()
    assert stats["tier_disk_corrupt"] == 1 and stats["tier_load_failures"] == 1, stats
    assert stats["prefix_tier_hit_tokens"] == 2 * PS, stats  # the two blocks before it loaded
    assert not damaged.exists()
    assert "checksum mismatch" in caplog.text
    assert_pool_idle(engine)
    engine.close()


def test_blocks_of_another_model_or_layout_are_never_loaded(tiny_dir, tmp_path):
    _written_before_a_restart(tiny_dir, tmp_path)
    # another page size (another layout and salt) finds nothing of them
    engine = _disk_engine(tiny_dir, tmp_path, page_size=8, kv_cache_tokens=24 * 8)
    _run(engine, "f", FOLLOW_UP)
    assert engine.pool_stats()["prefix_hit_tokens"] == 0
    engine.close()
    # a block file put in another salt's folder under the name it would have there is refused
    block = torch.randn(2, 2, 2, PS, 16)
    one = DiskTier(tmp_path / "one", 1 << 20, b"model-a", {"l": 1}, block.shape, block.dtype)
    two = DiskTier(tmp_path / "two", 1 << 20, b"model-b", {"l": 1}, block.shape, block.dtype)
    one.put(b"k" * 16, block)
    one.close()
    assert torch.equal(one.read(b"k" * 16), block)
    (two.folder / one.path(b"k" * 16).name).write_bytes(one.path(b"k" * 16).read_bytes())
    assert two.has(b"k" * 16) and two.read(b"k" * 16) is None
    assert two.stats()["corrupt"] == 1 and not (two.folder / one.path(b"k" * 16).name).exists()
    two.close()


def test_the_disk_tier_stays_under_its_size(tmp_path):
    block = torch.randn(2, 2, 2, PS, 16)
    tier = DiskTier(tmp_path, 3 * (block.nbytes + 200), b"s", {}, block.shape, block.dtype)
    for i in range(6):
        tier.put(bytes([i]) * 16, block)
    tier.close()
    assert tier.stats()["blocks"] == 3 and len(list(tier.folder.glob("*.kv"))) == 3
    assert [tier.has(bytes([i]) * 16) for i in range(6)] == [False] * 3 + [True] * 3


def test_a_cache_salt_keeps_tenants_apart(tiny_dir, reference):
    engine = make_engine(tiny_dir, page_size=PS)
    a = SamplingParams(max_tokens=8, ignore_eos=True, cache_salt="tenant-a")
    b = SamplingParams(max_tokens=8, ignore_eos=True, cache_salt="tenant-b")
    assert _run(engine, "a1", CHAT, a) == reference["chat"]
    assert _run(engine, "b1", FOLLOW_UP, b) == reference["follow_up"]
    assert engine.pool_stats()["prefix_hit_tokens"] == 0  # b does not see a's pages
    assert _run(engine, "a2", FOLLOW_UP, a) == reference["follow_up"]
    assert engine.pool_stats()["prefix_hit_tokens"] >= 15 * PS  # a sees its own
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="x" * 1000)


def test_a_request_ended_while_its_blocks_load_frees_its_pages_after_the_load(tiny_dir, reference):
    engine = make_engine(tiny_dir, page_size=PS, kv_cache_tokens=24 * PS, kv_host_tokens=200 * PS)
    _run(engine, "c", CHAT)
    _evict_everything(engine)
    release = __import__("threading").Event()
    copy = engine.tiers._copy
    engine.tiers._copy = lambda loads: (release.wait(10), copy(loads))[1]  # hold the load in flight
    engine.add_request("f", FOLLOW_UP, PARAMS)
    engine.step()
    assert engine._seqs["f"].status is SeqStatus.WAITING_TIER_KV
    out = engine.abort("f")
    assert out is not None and out.finished and not out.pages_held
    assert engine.allocator.has("f")  # the loader may still write them
    release.set()
    run_to_completion(engine)  # the engine has work until the load is done and its pages freed
    assert_pool_idle(engine)
    assert _run(engine, "again", FOLLOW_UP) == reference["follow_up"]
