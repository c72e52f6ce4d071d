"""KV tiers through real servers, the real model and real files: a server restarted on the same
disk tier serves a conversation's follow-up turn from the blocks its predecessor wrote at close,
read through NIXL's POSIX file backend (aggregated, and the decode instance of a disaggregated
one); in
a disaggregated deployment, a decode instance whose pool evicted turn 1 loads it back from its host
tier and asks the prefill instance only for the rest; a request of another ``cache_salt`` (tenant)
finds none of it; of two prefill instances on one real Redis, the second loads the prefix the
first computed from the shared tier (computes none of it) and sends it on to the decode instance;
two servers share a prefix through the store, lose it and get it back. Greedy outputs equal
transformers' throughout."""

from __future__ import annotations

import time

import pytest

from backend.client import stream_generate
from tests.conftest import deployment_server, hf_greedy, metric_values, wait_pool_free

SYSTEM = "You are a helpful assistant. " + " ".join(f"Rule {i}: answer briefly and politely." for i in range(14))
FIRST = SYSTEM + "\nUser: What is the capital of France?\nAssistant:"
SECOND = FIRST + " Paris.\nUser: And of Italy?\nAssistant:"


def _settled(url: str, name: str, model: str, timeout_s: float = 6.0) -> float:
    """A counter's value once it stopped moving (the gauges refresh every 0.25 s)."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        now = sum(metric_values(url, f"triton_disagg_{name}", model=model))
        if now == last:
            return now
        last = now
        time.sleep(0.6)
    return last or 0.0


def _greedy(grpc: str, prompt: str, **kw):
    out = stream_generate(grpc, prompt, 8, temperature=0.0, ignore_eos=True, **kw)
    assert out.error is None, out.error
    return out.token_ids


@pytest.mark.parametrize("mode", ["aggregated", "disagg"])
def test_a_restarted_server_serves_the_follow_up_from_the_disk_tier(
    mode, model_dir, tmp_path_factory, tokenizer, hf_model
):
    """Turn 1, then the server stops (its instances write the blocks hit often enough to disk) and
    starts again on the same folder: turn 2 loads turn 1 from the disk tier (aggregated: the
    instance; disaggregated: the decode instance, which asks the prefill instance for the rest)."""
    disk = tmp_path_factory.mktemp("kv-disk")
    overrides = {"kv_cache_tokens": "1024", "num_threads": "2", "kv_disk_path": str(disk), "kv_disk_admit_hits": "1"}
    if mode == "disagg":
        overrides["num_threads"] = "1"
    settings = dict(mode=mode, model_path=str(model_dir), overrides=overrides, timeout_s=300)
    model = "llm" if mode == "aggregated" else "decode_0"
    n_first = len(tokenizer(FIRST)["input_ids"])
    with deployment_server(tmp_path_factory, f"tiers-before-{mode}", **settings) as server:
        for _ in range(2):  # turn 1 twice: its blocks are hit once, enough for the disk tier here
            assert _greedy(server.grpc_url, FIRST) == hf_greedy(hf_model, tokenizer(FIRST)["input_ids"], 8)
    files = list(disk.rglob("*.kv"))
    assert len(files) >= (n_first - 1) // 16, files  # written when the server stopped
    with deployment_server(tmp_path_factory, f"tiers-after-{mode}", **settings) as server:
        url = server.metrics_url
        assert _greedy(server.grpc_url, SECOND) == hf_greedy(hf_model, tokenizer(SECOND)["input_ids"], 8)
        disk_hits = _settled(url, "kv_tier_disk_hit_blocks_total", model)
        assert disk_hits >= (n_first - 1) // 16, disk_hits  # all of turn 1 came from the files
        assert _settled(url, "kv_tier_hit_tokens_total", model) == disk_hits * 16
        assert _settled(url, "kv_tier_disk_corrupt_total", model) == 0
        # per tier: the disk tier's share of the load time, and its size in bytes (header + block each)
        assert _settled(url, "kv_tier_disk_load_seconds_total", model) > 0
        block_bytes = _settled(url, "kv_tier_block_bytes", model)
        disk_blocks = _settled(url, "kv_tier_disk_blocks", model)
        assert disk_blocks >= disk_hits and block_bytes > 0
        assert _settled(url, "kv_tier_disk_bytes", model) == disk_blocks * (block_bytes + 64)
        wait_pool_free(url, model)
        # kv_disk_reader=auto: the files were read through NIXL's POSIX backend (real NIXL)
        assert "read with NIXL POSIX (posix_aio)" in server.log_file.read_text()


def test_a_decode_instance_loads_an_evicted_turn_from_its_host_tier(model_dir, tmp_path_factory, tokenizer, hf_model):
    with deployment_server(
        tmp_path_factory,
        "tiers-disagg",
        mode="disagg",
        model_path=str(model_dir),
        prefill_instances=1,
        decode_instances=1,
        overrides={"kv_cache_tokens": "640", "kv_host_tokens": "8192", "num_threads": "1", "max_tokens_limit": "64"},
    ) as server:
        url, grpc = server.metrics_url, server.grpc_url
        sent = lambda: _settled(url, "kv_transfer_bytes_total", "prefill_0")  # noqa: E731
        assert _greedy(grpc, FIRST) == hf_greedy(hf_model, tokenizer(FIRST)["input_ids"], 8)
        b1 = sent()
        for i in range(4):  # other conversations push turn 1 out of both pools
            other = f"Story {i}: " + " ".join(f"the {i}th traveller walked {j} miles" for j in range(40))
            _greedy(grpc, other)
        assert _settled(url, "kv_tier_spilled_blocks_total", "decode_0") > 0
        b2 = sent()
        host_before = _settled(url, "kv_tier_host_hit_blocks_total", "decode_0")
        assert _greedy(grpc, SECOND) == hf_greedy(hf_model, tokenizer(SECOND)["input_ids"], 8)
        loaded = _settled(url, "kv_tier_host_hit_blocks_total", "decode_0") - host_before
        n_first, n_second = len(tokenizer(FIRST)["input_ids"]), len(tokenizer(SECOND)["input_ids"])
        assert loaded >= (n_first - 1) // 16 - 1, loaded
        per_page = b1 / -(-(n_first - 1) // 16)
        # only the pages after the loaded ones crossed the fabric
        assert sent() - b2 == per_page * (-(-(n_second - 1) // 16) - loaded)

        # another tenant's request for the same text finds none of it, in the pool or the tiers
        hits = _settled(url, "prefix_cache_hit_tokens_total", "decode_0")
        salted = stream_generate(grpc, SECOND, 8, temperature=0.0, ignore_eos=True, cache_salt="tenant-b")
        assert salted.error is None and salted.token_ids == hf_greedy(hf_model, tokenizer(SECOND)["input_ids"], 8)
        assert _settled(url, "prefix_cache_hit_tokens_total", "decode_0") == hits
        for m in ("prefill_0", "decode_0"):
            wait_pool_free(url, m)


def test_two_servers_share_a_prefix_through_the_store_and_survive_its_loss(
    model_dir, tmp_path_factory, tokenizer, hf_model
):
    """Two servers on one real Redis: a prefix one computed is loaded by the other (none of it
    computed there); with the store killed under load no request fails (they compute); once it is
    back, hits resume."""
    from backend.launch.kv_store_server import KVStoreServer

    store = KVStoreServer(log_file=tmp_path_factory.mktemp("redis") / "redis.log").start()
    overrides = {"kv_cache_tokens": "1024", "num_threads": "1", "kv_store_url": store.url, "kv_host_tokens": "0"}
    settings = dict(mode="aggregated", model_path=str(model_dir), overrides=overrides, timeout_s=300)
    want = lambda text: hf_greedy(hf_model, tokenizer(text)["input_ids"], 8)  # noqa: E731
    hits = lambda url: _settled(url, "kv_tier_shared_hit_blocks_total", "llm")  # noqa: E731
    try:
        with (
            deployment_server(tmp_path_factory, "shared-a", **settings) as a,
            deployment_server(tmp_path_factory, "shared-b", **settings) as b,
        ):
            assert _greedy(a.grpc_url, FIRST) == want(FIRST)
            time.sleep(1.0)  # a's writer puts turn 1's blocks in the store
            assert _greedy(b.grpc_url, SECOND) == want(SECOND)
            n_first = len(tokenizer(FIRST)["input_ids"])
            assert hits(b.metrics_url) >= (n_first - 1) // 16  # all of turn 1 came from the store

            store.kill()
            other = "Tell me about rivers. " + SYSTEM
            results = [stream_generate(b.grpc_url, other + f" Question {i}?", 8, temperature=0.0) for i in range(3)]
            assert all(r.error is None for r in results), [r.error for r in results]
            assert _settled(b.metrics_url, "kv_tier_shared_errors_total", "llm") >= 1
            assert _settled(b.metrics_url, "kv_tier_shared_up", "llm") == 0

            store = KVStoreServer(port=store.port, log_file=store.log_file).start()
            time.sleep(6.0)  # past the 5 s both servers leave a failed store alone
            third = "Tell me about mountains. " + SYSTEM
            assert _greedy(a.grpc_url, third + " Why?") == want(third + " Why?")
            time.sleep(1.0)
            before = hits(b.metrics_url)
            assert _greedy(b.grpc_url, third + " How?") == want(third + " How?")
            assert hits(b.metrics_url) > before  # hits resumed
            wait_pool_free(b.metrics_url, "llm")
    finally:
        store.stop()


def test_a_prefix_one_prefill_instance_computed_is_a_shared_tier_hit_on_the_other(
    model_dir, tmp_path_factory, tokenizer, hf_model
):
    """Two prefill instances and one decode instance (no prefix cache of its own, and picking
    prefill instances in turn, so each turn's prompt reaches a prefill instance whole): turn 1 is
    computed by one prefill instance, which writes its pages to the store; turn 2 goes to the
    other, which loads turn 1's pages from the store and computes only the rest."""
    from backend.launch.kv_store_server import KVStoreServer

    store = KVStoreServer(log_file=tmp_path_factory.mktemp("redis") / "redis.log").start()
    try:
        with deployment_server(
            tmp_path_factory,
            "shared-prefill",
            mode="disagg",
            model_path=str(model_dir),
            prefill_instances=2,
            decode_instances=1,
            overrides={"kv_cache_tokens": "1024", "num_threads": "1", "kv_store_url": store.url, "kv_host_tokens": "0"},
            per_model={"decode_0": {"enable_prefix_caching": "false", "kv_routing_weight": "0"}},
        ) as server:
            url, grpc = server.metrics_url, server.grpc_url
            sent = {m: _settled(url, "kv_transfer_bytes_total", m) for m in ("prefill_0", "prefill_1")}
            assert _greedy(grpc, FIRST) == hf_greedy(hf_model, tokenizer(FIRST)["input_ids"], 8)
            first = next(m for m in sent if _settled(url, "kv_transfer_bytes_total", m) > sent[m])
            other = "prefill_1" if first == "prefill_0" else "prefill_0"
            n_first = len(tokenizer(FIRST)["input_ids"])
            pages = (n_first - 1) // 16
            assert _settled(url, "kv_tier_shared_writes_total", first) >= pages  # written through
            hit_before = _settled(url, "prefix_cache_hit_tokens_total", other)
            assert _greedy(grpc, SECOND) == hf_greedy(hf_model, tokenizer(SECOND)["input_ids"], 8)
            assert _settled(url, "kv_transfer_bytes_total", other) > 0, f"turn 2 went to {first} again"
            assert _settled(url, "kv_tier_shared_hit_blocks_total", other) >= pages
            # none of turn 1's full pages was computed on the other prefill instance
            assert _settled(url, "prefix_cache_hit_tokens_total", other) - hit_before >= pages * 16
            for m in ("prefill_0", "prefill_1", "decode_0"):
                wait_pool_free(url, m)
    finally:
        store.stop()
