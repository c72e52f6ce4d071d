"""KV tiers below the pool (``kv_tiers.py``, ``host_tier.py``, ``disk_tier.py``) on the tiny model:
a prefix evicted from the pool comes back from the host tier, and from the disk tier in a new
engine (a restart), with greedy outputs equal to an engine without tiers; a damaged block file or
one written for another model or layout is never loaded (the prompt is computed, the output is the
same); a request's ``cache_salt`` keeps its pages from other tenants; a request ended while its
blocks load frees its pages once the load is done. The same with the real model through a real
server: ``tests/integration/test_kv_tiers_e2e.py``."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_helpers import TINY_VOCAB, assert_pool_idle, build_tiny_llama, make_engine, run_to_completion, tokens_of

from backend.engine.disk_tier import DiskTier
from backend.engine.file_reader import PlainFileReader
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
    # routers see the evicted history in the summary's tier keys (cache_summary.py)
    from backend.engine.cache_summary import page_key
    from backend.engine.page_allocator import page_hashes

    summary = engine.cache_summary()
    chat_keys = {page_key(h) for h in page_hashes(CHAT, PS, engine.allocator.salt)}
    assert chat_keys <= summary.tier_keys and not chat_keys & summary.keys
    assert _run(engine, "f", FOLLOW_UP) == reference["follow_up"]
    stats = engine.pool_stats()
    assert stats["prefix_tier_hit_tokens"] >= 15 * PS, stats  # the whole history came from the tier
    assert stats["tier_host_hit_blocks"] >= 15 and stats["tier_load_failures"] == 0, stats
    # per tier: the follow-up's new blocks missed the host tier (no disk tier asked), its load took time
    assert stats["tier_host_miss_blocks"] >= 1 and stats["tier_disk_miss_blocks"] == 0, stats
    assert stats["tier_host_load_seconds"] > 0 and stats["tier_disk_load_seconds"] == 0, stats
    assert stats["tier_host_load_seconds"] <= stats["tier_load_seconds"], stats
    assert stats["tier_host_evicted_blocks"] == 0, stats  # 200 pages hold everything evicted here
    (_, block), *_ = engine.tiers.host.items()
    assert stats["tier_block_bytes"] == block.nbytes > 0  # a tier's bytes: its blocks times this
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


def test_a_full_disk_drops_the_blocks_logs_once_and_costs_only_recomputation(
    tiny_dir, reference, tmp_path, monkeypatch, caplog
):
    """Every block file the tier starts is backed by ``/dev/full`` (the kernel's full device:
    each write fails with ENOSPC): the blocks are dropped and counted, the failure is logged once,
    no partial file is left, and a restarted engine finds nothing and computes the same output."""
    import errno
    import os
    import tempfile

    from backend.engine import disk_tier

    mkstemp = tempfile.mkstemp

    def full_mkstemp(*args, **kwargs):
        fd, path = mkstemp(*args, **kwargs)
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, fd)
        os.close(full)
        return fd, path

    monkeypatch.setattr(disk_tier.tempfile, "mkstemp", full_mkstemp)
    engine = _disk_engine(tiny_dir, tmp_path)
    with caplog.at_level("WARNING", logger="triton_disagg.engine"):
        assert _run(engine, "c1", CHAT) == reference["chat"]
        assert _run(engine, "f", FOLLOW_UP) == reference["follow_up"]
        engine.close()  # the blocks hit once are written at close: every write fails
    stats = engine.tiers.disk.stats()
    assert stats["writes"] == 0 and stats["dropped"] >= 15 and stats["blocks"] == 0, stats
    assert caplog.text.count(os.strerror(errno.ENOSPC)) == 1, caplog.text  # logged once
    assert not list(tmp_path.rglob("*.kv")) and not list(tmp_path.rglob("*.tmp"))
    monkeypatch.undo()
    engine = _disk_engine(tiny_dir, tmp_path)
    assert _run(engine, "f", FOLLOW_UP) == reference["follow_up"]
    assert engine.pool_stats()["tier_disk_hit_blocks"] == 0
    assert_pool_idle(engine)
    engine.close()


class CountingReader(PlainFileReader):
    """Plain file I/O that remembers how many files each read was given."""

    name = "counting reader"

    def __init__(self):
        self.batches: list[int] = []

    def read(self, fds, size, into):
        self.batches.append(len(fds))
        super().read(fds, size, into)


class FailingReader:
    name = "failing reader"

    def __init__(self):
        self.closed = False

    def read(self, fds, size, into):
        raise OSError("no such transport")

    def close(self):
        self.closed = True


def test_disk_blocks_are_read_in_batches_of_at_most_the_staging_buffer(tiny_dir, reference, tmp_path):
    _written_before_a_restart(tiny_dir, tmp_path)
    reader = CountingReader()
    engine = _disk_engine(tiny_dir, tmp_path, disk_reader=lambda: reader)
    assert engine.tiers.disk.reader is reader
    engine.tiers.disk.batch_blocks = 4  # the staging buffer holds 4 blocks
    assert _run(engine, "f", FOLLOW_UP) == reference["follow_up"]
    assert engine.pool_stats()["tier_disk_hit_blocks"] >= 15
    assert reader.batches and max(reader.batches) == 4 and sum(reader.batches) >= 15, reader.batches
    with pytest.raises(ValueError, match="at most 4"):
        engine.tiers.disk.read_many([b"k" * 16] * 5)
    assert_pool_idle(engine)
    engine.close()


def test_a_file_reader_that_fails_gives_way_to_plain_file_io(tiny_dir, reference, tmp_path, caplog):
    _written_before_a_restart(tiny_dir, tmp_path)
    failing = FailingReader()
    engine = _disk_engine(tiny_dir, tmp_path, disk_reader=lambda: failing)
    with caplog.at_level("WARNING", logger="triton_disagg.engine"):
        assert _run(engine, "f", FOLLOW_UP) == reference["follow_up"]
    stats = engine.pool_stats()
    assert stats["tier_disk_hit_blocks"] >= 15 and stats["tier_disk_corrupt"] == 0, stats  # no file blamed
    assert isinstance(engine.tiers.disk.reader, PlainFileReader) and failing.closed
    assert stats["tier_disk_read_errors"] == 1, stats  # the failed read, done again plainly
    assert caplog.text.count("failing reader failed (OSError: no such transport); reading with plain file I/O") == 1
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
    assert tier.stats()["evicted"] == 3
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


def _engine_with_held_loads(tiny_dir):
    """An engine whose pool evicted the chat into its host tier, and whose tier loads wait (in
    flight) until the returned event is set."""
    import threading

    engine = make_engine(tiny_dir, page_size=PS, kv_cache_tokens=24 * PS, kv_host_tokens=200 * PS)
    _run(engine, "c", CHAT)
    _evict_everything(engine)
    release = threading.Event()
    copy = engine.tiers._copy
    engine.tiers._copy = lambda loads: (release.wait(10), copy(loads))[1]
    return engine, release


def test_a_request_ended_while_its_blocks_load_frees_its_pages_after_the_load(tiny_dir, reference):
    engine, release = _engine_with_held_loads(tiny_dir)
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


def test_a_prefill_only_request_ended_mid_load_is_not_released_under_the_loader(tiny_dir):
    """A prefill instance's request (its pages are normally held until ``release``) ended while
    its blocks load: ``release`` leaves the pages to the load, which frees them when it is done."""
    engine, release = _engine_with_held_loads(tiny_dir)
    engine.add_request("p", FOLLOW_UP, SamplingParams(max_tokens=1), prefill_only=True)
    engine.step()
    out = engine.abort("p")
    assert out is not None and not out.pages_held
    assert engine.release("p") == 0 and engine.allocator.has("p")  # not freed under the loader
    release.set()
    run_to_completion(engine)
    assert_pool_idle(engine)


class DictStore:
    """A shared store in this process (the real one, Redis, in tests/integration/test_kv_tiers_e2e.py):
    ``down`` makes every call fail as an unreachable store's would."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.down = False
        self.calls = 0
        self.answer = threading.Event()  # cleared: a lookup waits (a slow store) until it is set
        self.answer.set()

    def _call(self):
        self.calls += 1
        if self.down:
            raise ConnectionError("connection refused")

    def exists(self, names):
        self._call()
        self.answer.wait(30)
        return [n in self.values for n in names]

    def get(self, name):
        self._call()
        return self.values.get(name)

    def put(self, name, data):
        self._call()
        self.values[name] = data

    def describe(self):
        return "dict://test"


def _shared_engine(tiny_dir, store):
    return make_engine(tiny_dir, store=store, page_size=PS, kv_host_tokens=0)


def _settle(engine):
    assert engine.tiers.shared.drain()  # the writer has written what it was given


def test_a_prefix_one_engine_computed_is_loaded_by_another_from_the_shared_tier(tiny_dir, reference):
    store = DictStore()
    first = _shared_engine(tiny_dir, store)
    assert _run(first, "c", CHAT) == reference["chat"]
    _settle(first)
    assert len(store.values) >= 15  # every computed full page went to the store
    second = _shared_engine(tiny_dir, store)
    assert _run(second, "f", FOLLOW_UP) == reference["follow_up"]
    stats = second.pool_stats()
    assert stats["tier_shared_hits"] >= 15 and stats["prefix_tier_hit_tokens"] >= 15 * PS, stats
    assert stats["tier_shared_up"] == 1 and stats["tier_shared_errors"] == 0
    assert_pool_idle(second)


def test_a_store_that_is_down_costs_only_recomputation_and_is_tried_again(tiny_dir, reference, caplog):
    store = DictStore()
    first = _shared_engine(tiny_dir, store)
    _run(first, "c", CHAT)
    _settle(first)
    store.down = True
    second = _shared_engine(tiny_dir, store)
    second.tiers.shared.retry_s = 3.0  # longer than the down phase takes, even on a loaded machine
    assert _run(second, "f1", FOLLOW_UP) == reference["follow_up"]  # computed: no error, no hang
    stats = second.pool_stats()
    assert stats["tier_shared_hits"] == 0 and stats["tier_shared_errors"] >= 1 and stats["tier_shared_up"] == 0
    assert caplog.text.count("dict://test") == 1  # one line per outage
    calls = store.calls
    assert _run(second, "f2", CHAT + _tokens(3, 9)) == _run(
        make_engine(tiny_dir, page_size=PS), "x", CHAT + _tokens(3, 9)
    )
    assert store.calls == calls  # while down, nothing is asked of it
    store.down = False
    __import__("time").sleep(3.1)  # past the retry window: it is tried again
    third = CHAT + _tokens(4, 9)
    assert _run(second, "f3", third) == _run(make_engine(tiny_dir, page_size=PS), "y", third)
    assert second.pool_stats()["tier_shared_up"] == 1  # tried again, and it answers


def test_a_damaged_shared_block_is_computed_again(tiny_dir, reference):
    store = DictStore()
    first = _shared_engine(tiny_dir, store)
    _run(first, "c", CHAT)
    _settle(first)
    from backend.engine.page_allocator import page_hashes

    third = page_hashes(CHAT, PS, first.allocator.salt)[2]
    name = next(n for n in store.values if n.endswith(third.hex()))
    data = bytearray(store.values[name])
    data[-3] ^= 0x55
    store.values[name] = bytes(data)
    second = _shared_engine(tiny_dir, store)
    assert _run(second, "f", FOLLOW_UP) == reference["follow_up"]
    stats = second.pool_stats()
    assert stats["tier_shared_corrupt"] == 1 and stats["prefix_tier_hit_tokens"] == 2 * PS, stats
    assert_pool_idle(second)


def test_a_truncated_or_longer_block_file_is_refused(tmp_path):
    block = torch.randn(2, 2, 2, PS, 16)
    tier = DiskTier(tmp_path, 1 << 20, b"s", {}, block.shape, block.dtype)
    for key in (b"a" * 16, b"b" * 16, b"c" * 16):
        tier.put(key, block)
    tier.close()
    short, long_ = tier.path(b"a" * 16), tier.path(b"b" * 16)
    short.write_bytes(short.read_bytes()[:-100])
    long_.write_bytes(long_.read_bytes() + b"x")
    assert tier.read(b"a" * 16) is None and tier.read(b"b" * 16) is None
    assert torch.equal(tier.read(b"c" * 16), block)
    assert tier.stats()["corrupt"] == 2 and not short.exists() and not long_.exists()


def test_a_load_in_flight_does_not_hold_up_the_other_requests(tiny_dir, reference):
    """While one request's blocks load (held here), another request's steps go on and finish."""
    engine, release = _engine_with_held_loads(tiny_dir)
    engine.add_request("f", FOLLOW_UP, PARAMS)
    engine.add_request("other", _tokens(9, 7), PARAMS)
    tokens = []
    for _ in range(40):
        tokens += [t for out in engine.step() if out.req_id == "other" for t in out.new_token_ids]
        if len(tokens) == PARAMS.max_tokens:
            break
    assert len(tokens) == PARAMS.max_tokens  # all of it while f's load was still held
    assert engine._seqs["f"].status is SeqStatus.WAITING_TIER_KV
    release.set()
    assert tokens_of(run_to_completion(engine)["f"]) == reference["follow_up"]
    assert_pool_idle(engine)


def _slow_store_engines(tiny_dir):
    """A store holding CHAT's blocks (computed by another engine) that does not answer lookups
    until ``store.answer`` is set, and a fresh engine that knows nothing of it."""
    store = DictStore()
    first = _shared_engine(tiny_dir, store)
    _run(first, "c", CHAT)
    _settle(first)
    store.answer.clear()
    return store, _shared_engine(tiny_dir, store)


def test_a_slow_store_never_holds_up_a_step(tiny_dir, reference, monkeypatch):
    """The shared tier is asked off the engine's thread: while it has not answered, the request
    it is asked for waits (holding no pages) and another request's steps go on and finish; once
    it answers, the request loads its prefix from it."""
    from backend.engine import llm_engine

    monkeypatch.setattr(llm_engine, "LOOKUP_WAIT_S", 60.0)  # the test answers, not the clock
    store, engine = _slow_store_engines(tiny_dir)
    engine.add_request("other", _tokens(9, PS), PARAMS)  # no full page: nothing to look up
    engine.add_request("f", FOLLOW_UP, PARAMS)
    assert engine._seqs["f"].status is SeqStatus.WAITING_TIER_LOOKUP and not engine.allocator.has("f")
    tokens = []
    for _ in range(40):
        tokens += [t for out in engine.step() if out.req_id == "other" for t in out.new_token_ids]
        if len(tokens) == PARAMS.max_tokens:
            break
    assert len(tokens) == PARAMS.max_tokens  # all of it while f's lookup was unanswered
    assert engine._seqs["f"].status is SeqStatus.WAITING_TIER_LOOKUP
    store.answer.set()
    assert tokens_of(run_to_completion(engine)["f"]) == reference["follow_up"]
    assert engine.pool_stats()["tier_shared_hits"] >= 15
    assert_pool_idle(engine)


def test_a_store_that_does_not_answer_in_time_is_not_waited_for(tiny_dir, reference, monkeypatch):
    """After ``LOOKUP_WAIT_S`` without an answer the request is computed; an abort while it waits
    leaves nothing behind."""
    from backend.engine import llm_engine

    monkeypatch.setattr(llm_engine, "LOOKUP_WAIT_S", 0.2)
    store, engine = _slow_store_engines(tiny_dir)
    engine.add_request("gone", FOLLOW_UP + [5], PARAMS)
    assert engine.abort("gone") is not None
    try:
        assert _run(engine, "f", FOLLOW_UP) == reference["follow_up"]
        assert engine.pool_stats()["tier_shared_hits"] == 0
    finally:
        store.answer.set()
    assert_pool_idle(engine)
