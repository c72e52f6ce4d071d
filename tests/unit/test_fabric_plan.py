"""Pure unit tests of the layout check and the transfer plan (no NIXL, no processes)."""

import random

import numpy as np
import pytest

from fabric_bridge.layout import KVLayout, LayoutMismatch, check_compatible
from fabric_bridge.plan import build_plan, choose_pairs, expected_writes, writes_per_page


def lay(tp=1, layout="HND", heads=8, **kw):
    base = dict(
        model="m",
        num_layers=3,
        page_size=16,
        num_kv_heads=heads,
        head_dim=64,
        dtype="float32",
        tp_size=tp,
        layout=layout,
    )
    base.update(kw)
    return KVLayout(**base)


@pytest.mark.parametrize(
    "src_tp,dst_tp,hnd,nhd",
    [
        (1, 1, 1, 1),  # whole page, K and V adjacent: one write either way
        (1, 2, 4, 64),  # per dst shard: K slice + V slice (HND) vs per token per K/V (NHD)
        (2, 1, 4, 64),
        (1, 4, 8, 128),
        (4, 2, 8, 128),
        (2, 2, 2, 2),
    ],
)
def test_write_counts_hnd_vs_nhd(src_tp, dst_tp, hnd, nhd):
    assert writes_per_page(lay(src_tp), lay(dst_tp)) == hnd
    assert writes_per_page(lay(src_tp, "NHD"), lay(dst_tp, "NHD")) == nhd
    plan = build_plan(lay(src_tp), lay(dst_tp), [0, 1], [2, 3])
    assert plan.writes(n_layers=3) == hnd * 2 * 3


def test_mixed_layouts_write_one_row_per_head_token():
    # HND -> NHD with the same heads: nothing stays contiguous beyond one head_dim row.
    assert writes_per_page(lay(1, "HND"), lay(1, "NHD")) == 2 * 8 * 16


def test_segments_cover_each_destination_byte_once():
    for src_tp, dst_tp, heads in [(1, 4, 8), (4, 1, 8), (2, 4, 8), (6, 1, 3), (16, 4, 8), (1, 6, 3)]:
        for src_l, dst_l in [("HND", "HND"), ("NHD", "NHD"), ("HND", "NHD")]:
            src, dst = lay(src_tp, src_l, heads), lay(dst_tp, dst_l, heads)
            covered = {d: np.zeros(dst.page_bytes, dtype=int) for d in range(dst_tp)}
            for p in choose_pairs(src, dst, random.Random(1)):
                assert (p.src_off + p.length <= src.page_bytes).all()
                for o, n in zip(p.dst_off, p.length):
                    covered[p.dst_shard][o : o + n] += 1
            for d, c in covered.items():
                assert (c == 1).all(), (src_tp, dst_tp, src_l, dst_l, d)


def test_head_slices_split_and_assemble():
    # 1 -> 2: destination shard 1 takes heads 4..7 of the single source shard, K then V.
    pairs = choose_pairs(lay(1), lay(2))
    p1 = [p for p in pairs if p.dst_shard == 1][0]
    kv_bytes = 8 * 16 * 64 * 4  # K of all 8 source heads
    head_bytes = 16 * 64 * 4
    assert p1.src_off.tolist() == [4 * head_bytes, kv_bytes + 4 * head_bytes]
    assert p1.dst_off.tolist() == [0, 4 * head_bytes]
    assert p1.length.tolist() == [4 * head_bytes] * 2
    # 4 -> 1: one destination page assembled from 4 sources (2 heads each).
    pairs = choose_pairs(lay(4), lay(1))
    assert sorted(p.src_shard for p in pairs) == [0, 1, 2, 3]
    assert {p.dst_shard for p in pairs} == {0}


def test_replica_choice_is_random_per_request_and_seeded():
    src, dst = lay(16), lay(4)  # 8 heads over 16 shards: every head on 2 shards
    picks = {tuple(p.src_shard for p in build_plan(src, dst, [0], [0], random.Random(s)).pairs) for s in range(20)}
    assert len(picks) > 1, "replica choice never varies"
    a = build_plan(src, dst, [0], [0], random.Random(42)).pairs
    b = build_plan(src, dst, [0], [0], random.Random(42)).pairs
    assert [p.src_shard for p in a] == [p.src_shard for p in b]
    for p in a:  # the chosen replica holds the head the destination needs
        assert set(src.shard_heads(p.src_shard)) <= set(dst.shard_heads(p.dst_shard))
    # 3 KV heads on TP 6: a TP-1 receiver gets each head once, from one of its 2 replicas.
    pairs = choose_pairs(lay(6, heads=3), lay(1, heads=3), random.Random(0))
    assert sorted(lay(6, heads=3).shard_heads(p.src_shard).start for p in pairs) == [0, 1, 2]


@pytest.mark.parametrize("src_tp,dst_tp,heads", [(1, 2, 8), (4, 2, 8), (6, 1, 3), (1, 6, 3), (16, 4, 8)])
def test_expected_count_agrees_with_every_plan(src_tp, dst_tp, heads):
    src, dst = lay(src_tp, heads=heads), lay(dst_tp, heads=heads)
    n = expected_writes(src, dst, n_pages=5)
    for seed in range(5):
        plan = build_plan(src, dst, range(5), range(5, 10), random.Random(seed))
        assert plan.writes(n_layers=src.num_layers) == n
    chunks = [3, 3]  # two chunks sharing one page
    assert expected_writes(src, dst, 5, chunk_pages=chunks) == n // 5 * 6
    assert expected_writes(src, dst, 5, n_layers=1) == n // 3


def test_incompatible_layouts_are_named():
    with pytest.raises(LayoutMismatch) as e:
        check_compatible(lay(), lay(head_dim=128, dtype="bfloat16"))
    msg = str(e.value)
    assert "head_dim: 64 vs 128" in msg and "dtype: 'float32' vs 'bfloat16'" in msg
    for field, value in [("model", "other"), ("page_size", 32), ("num_layers", 4), ("num_kv_heads", 4)]:
        with pytest.raises(LayoutMismatch, match=field):
            build_plan(lay(), lay(**{field: value}), [0], [0])
    check_compatible(lay(1, "HND"), lay(4, "NHD", mem_kind="VRAM"))  # these may differ


def test_layout_validation():
    with pytest.raises(ValueError, match="cannot be sharded"):
        lay(3)  # 8 heads over TP 3
    with pytest.raises(ValueError, match="page count differs"):
        build_plan(lay(), lay(), [0, 1], [0])
    assert lay(16).replicas == 2 and lay(16).heads_per_shard == 1
    assert lay(2).page_shape() == (2, 4, 16, 64) and lay(2, "NHD").page_shape() == (16, 2, 4, 64)
