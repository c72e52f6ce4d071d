"""fabric_bridge end to end over real NIXL (UCX) between two processes: byte-exact KV pages
for every sharding case, layer-wise streaming, and the metadata block."""

import itertools
import time

import numpy as np
import pytest
import torch
from fabric_helpers import Side, Worker, from_bytes

from fabric_bridge.layout import KVLayout
from fabric_bridge.plan import expected_writes

LAYERS, PAGE, HEAD_DIM, SRC_PAGES, DST_PAGES = 2, 4, 8, 6, 8
SRC_IDS, DST_IDS = [5, 0, 3], [1, 7, 4]  # request pages, deliberately out of order

# (source TP, destination TP, KV heads): every split with 8 heads, plus replicated caches.
SHARDINGS = [(1, 1, 8), (1, 2, 8), (2, 1, 8), (1, 4, 8), (4, 2, 8), (6, 1, 3), (16, 4, 8), (2, 16, 8)]
CASES = list(itertools.product(SHARDINGS, ["HND", "NHD"], ["float32", "bfloat16"]))
CASES.append(((2, 4, 8), ("HND", "NHD"), "float32"))  # the two sides may order pages differently


def layout(tp, heads, lay, dtype):
    return KVLayout("synthetic", LAYERS, PAGE, heads, HEAD_DIM, dtype, tp, lay)


def full_page(pools, lay: KVLayout, layer, page):
    """Logical [2, heads, page, dim] of one page, assembled from the first replica of each head."""
    parts, seen = [], set()
    for s in range(lay.tp_size):
        heads = lay.shard_heads(s)
        if heads.start in seen:
            continue
        seen.add(heads.start)
        p = pools[s][layer, page]
        parts.append(p if lay.layout == "HND" else p.permute(1, 2, 0, 3))
    return torch.cat(parts, dim=1)


def to_layout(logical, lay: KVLayout):
    return logical if lay.layout == "HND" else logical.permute(2, 0, 1, 3)


@pytest.fixture(scope="module")
def sides():
    worker, local = Worker(), Side()
    try:
        yield worker, local
    finally:
        local.close()
        worker.kill()


def connect_pair(worker, local, src, dst, tag, **kw):
    port = worker.create(f"src{tag}", src.to_dict(), SRC_PAGES, seed=7, **kw)
    local.create(f"dst{tag}", dst.to_dict(), DST_PAGES, **kw)
    peer = local.connect(f"dst{tag}", port)
    assert peer == f"src{tag}"
    return f"dst{tag}"


def case_id(case):
    (src_tp, dst_tp, heads), lay, dtype = case
    return f"tp{src_tp}to{dst_tp}_h{heads}-{lay if isinstance(lay, str) else '2'.join(lay)}-{dtype}"


@pytest.mark.parametrize("shard,lay,dtype", CASES, ids=[case_id(c) for c in CASES])
def test_byte_exact_pages(sides, shard, lay, dtype):
    worker, local = sides
    src_tp, dst_tp, heads = shard
    src_lay, dst_lay = (lay, lay) if isinstance(lay, str) else lay
    src, dst = layout(src_tp, heads, src_lay, dtype), layout(dst_tp, heads, dst_lay, dtype)
    tag = f"{src_tp}{dst_tp}{heads}{src_lay}{dst_lay}{dtype}"
    try:
        connect_pair(worker, local, src, dst, tag)
        n = expected_writes(src, dst, len(SRC_IDS))
        gen, _ = local.expect(f"dst{tag}", "r", n, timeout_s=20, with_meta=False)
        assert all(worker.post(f"src{tag}", f"dst{tag}", "r", gen, SRC_IDS, DST_IDS, range(LAYERS), rng_seed=3))
        done, ok, err, _ = local.wait("r")
        assert done and ok, err

        src_pools = [from_bytes(a, src, SRC_PAGES) for a in worker.read_pools(f"src{tag}")]
        dst_pools = local.pools[f"dst{tag}"]
        for layer in range(LAYERS):
            for sp, dp in zip(SRC_IDS, DST_IDS):
                logical = full_page(src_pools, src, layer, sp)
                for d in range(dst_tp):
                    want = to_layout(logical[:, dst.shard_heads(d).start : dst.shard_heads(d).stop], dst)
                    assert torch.equal(dst_pools[d][layer, dp], want), (layer, sp, dp, d)
            untouched = [p for p in range(DST_PAGES) if p not in DST_IDS]
            for d in range(dst_tp):
                assert not dst_pools[d][layer, untouched].any(), "a page outside the plan was written"
    finally:
        local.close(f"dst{tag}")
        worker.close(f"src{tag}")


def test_layer_streaming_and_meta(sides):
    """The receiver sees layer 0 land while the sender has not posted layer 1+, and the meta
    block arrives with the completion."""
    worker, local = sides
    layers = 4
    src = KVLayout("synthetic", layers, PAGE, 8, HEAD_DIM, "float32", 1)
    dst = KVLayout("synthetic", layers, PAGE, 8, HEAD_DIM, "float32", 2)
    try:
        port = worker.create("s_stream", src.to_dict(), SRC_PAGES, seed=11)
        local.create("d_stream", dst.to_dict(), DST_PAGES)
        local.connect("d_stream", port)
        n = expected_writes(src, dst, len(SRC_IDS))
        per_layer = n // layers
        gen, slot = local.expect("d_stream", "m", n, timeout_s=20, with_meta=True, peer="s_stream")
        assert worker.post("s_stream", "d_stream", "m", gen, SRC_IDS, DST_IDS, [0]) == [True]

        # Layer 0 alone completes: counter and bytes, before layer 1 is even posted.
        t_end = local.now() + 10
        while local.progress("d_stream", "m") != (per_layer, n) and local.now() < t_end:
            time.sleep(0.005)
        assert local.progress("d_stream", "m") == (per_layer, n)
        src_pools = [from_bytes(a, src, SRC_PAGES) for a in worker.read_pools("s_stream")]
        dst_pools = local.pools["d_stream"]
        assert torch.equal(dst_pools[0][0, DST_IDS[0]], src_pools[0][0, SRC_IDS[0], :, :4])
        assert not dst_pools[0][1:].any(), "later layers must not have arrived yet"
        assert not local.handles["m"].done.is_set()

        assert all(worker.post("s_stream", "d_stream", "m", gen, SRC_IDS, DST_IDS, range(1, layers)))
        hidden = np.linspace(-1, 1, 16, dtype=np.float32)
        logits = np.arange(40, dtype=np.float32) / 7
        assert worker.post_meta("s_stream", "d_stream", "m", gen, slot, hidden.tolist(), logits.tolist())
        worker.finish("s_stream", "m")
        done, ok, err, meta = local.wait("m")
        assert done and ok, err
        np.testing.assert_array_equal(meta, np.concatenate([hidden, logits]))
        assert worker.wait_sent("m")[:2] == (True, None)
        assert torch.equal(dst_pools[1][layers - 1, DST_IDS[2]], src_pools[0][layers - 1, SRC_IDS[2], :, 4:])
    finally:
        local.close("d_stream")
        worker.close("s_stream")


def test_chunked_posts_count_per_chunk(sides):
    """Two prefill chunks sharing a boundary page: each chunk posts its pages, the receiver
    expects the sum, and the shared page holds the last chunk's data."""
    worker, local = sides
    src = KVLayout("synthetic", LAYERS, PAGE, 8, HEAD_DIM, "float32", 2)
    dst = KVLayout("synthetic", LAYERS, PAGE, 8, HEAD_DIM, "float32", 1)
    try:
        port = worker.create("s_chunk", src.to_dict(), SRC_PAGES, seed=5)
        local.create("d_chunk", dst.to_dict(), DST_PAGES)
        local.connect("d_chunk", port)
        chunks = [[0, 1], [1, 2]]
        n = expected_writes(src, dst, len(SRC_IDS), chunk_pages=[len(c) for c in chunks])
        gen, _ = local.expect("d_chunk", "c", n, timeout_s=20, with_meta=False)
        for c in chunks:
            assert all(worker.post("s_chunk", "d_chunk", "c", gen, SRC_IDS, DST_IDS, range(LAYERS), positions=c))
        done, ok, err, _ = local.wait("c")
        assert done and ok, err
        src_pools = [from_bytes(a, src, SRC_PAGES) for a in worker.read_pools("s_chunk")]
        got = local.pools["d_chunk"][0][1, DST_IDS[1]]
        assert torch.equal(got, torch.cat([src_pools[0][1, SRC_IDS[1]], src_pools[1][1, SRC_IDS[1]]], dim=1))
    finally:
        local.close("d_chunk")
        worker.close("s_chunk")
