"""Faults over real NIXL between two processes: a peer killed mid-transfer, receiver
timeout, cancel on either side, and late writes after a cancel (generation + quarantine)."""

import signal
import time

import pytest
import torch
from fabric_helpers import Side, Worker, from_bytes

from fabric_bridge.layout import KVLayout
from fabric_bridge.plan import expected_writes

LAYERS, PAGES = 3, 6
SRC = KVLayout("synthetic", LAYERS, 4, 8, 8, "float32", 1)
DST = KVLayout("synthetic", LAYERS, 4, 8, 8, "float32", 2)
SRC_IDS, DST_IDS = [0, 1, 2], [3, 4, 5]
N = expected_writes(SRC, DST, len(SRC_IDS))


def pair(worker, local, tag, sender_remote=True, **kw):
    """Connect a sender and a receiver; return (sender side, receiver side) names."""
    s, r = f"s_{tag}", f"r_{tag}"
    if sender_remote:
        port = worker.create(s, SRC.to_dict(), PAGES, seed=3, **kw)
        local.create(r, DST.to_dict(), PAGES, **kw)
        local.connect(r, port)
    else:
        port = worker.create(r, DST.to_dict(), PAGES, **kw)
        local.create(s, SRC.to_dict(), PAGES, seed=3, **kw)
        local.connect(s, port)
    return s, r


@pytest.fixture
def local():
    side = Side()
    try:
        yield side
    finally:
        side.close()


@pytest.fixture
def worker():
    w = Worker()
    try:
        yield w
    finally:
        w.kill()


def test_receiver_times_out_when_sender_killed(worker, local):
    s, r = pair(worker, local, "ks", quarantine_s=0.5)
    gen, _ = local.expect(r, "q", N, timeout_s=1.5, with_meta=False, peer=s)
    assert worker.post(s, r, "q", gen, SRC_IDS, DST_IDS, [0]) == [True]
    end = time.monotonic() + 10
    while local.progress(r, "q") != (N // LAYERS, N) and time.monotonic() < end:
        time.sleep(0.005)
    worker.kill()  # mid-transfer: layer 0 landed, layers 1.. never come
    done, ok, err, _ = local.wait("q", timeout=10)
    failed_at = time.monotonic()
    assert done and ok is False and err.startswith(f"timeout (transfer): {N // LAYERS}/{N} writes")
    released = local.wait_released("q", timeout=10)
    assert released is not None and released - failed_at >= 0.4  # quarantine, no confirmation
    assert local.agents[r].pending() == 0


def test_sender_gets_error_when_receiver_killed(worker, local):
    s, r = pair(worker, local, "kr", sender_remote=False, xfer_timeout_s=3.0)
    gen, _ = worker.expect(r, "q", N, timeout_s=30, with_meta=False, peer=s)
    assert local.post(s, r, "q", gen, SRC_IDS, DST_IDS, [0]) == [True]
    worker.kill()
    t0 = time.monotonic()
    late = local.post(s, r, "q", gen, SRC_IDS, DST_IDS, [1, 2])  # must not raise or hang
    local.finish(s, "q")
    sent = local.wait_sent("q", timeout=20)
    assert len(sent) == 3, "sender hung on a dead peer"
    ok, err, _ = sent
    assert ok is False and err, (late, err)
    assert time.monotonic() - t0 < 20
    assert [e[:2] for e in local.get_errors()] == [("q", gen)]
    print("sender error:", err)


@pytest.fixture(scope="module")
def shared():
    w, side = Worker(), Side()
    try:
        yield w, side
    finally:
        side.close()
        w.kill()


def test_timeout_with_live_sender_is_confirmed_and_stops_it(shared):
    worker, local = shared
    s, r = pair(worker, local, "to", quarantine_s=30.0)
    gen, _ = local.expect(r, "t", N, timeout_s=1.0, with_meta=False, peer=s)
    assert worker.post(s, r, "t", gen, SRC_IDS, DST_IDS, [0]) == [True]
    done, ok, err, _ = local.wait("t", timeout=10)
    assert done and ok is False and "timeout" in err
    released = local.wait_released("t", timeout=10)
    assert released is not None, "sender never confirmed the stop"  # well before 30 s quarantine
    assert worker.post(s, r, "t", gen, SRC_IDS, DST_IDS, [1, 2]) == [False, False]
    worker.finish(s, "t")
    assert worker.wait_sent("t")[:2] == (False, "cancelled by receiver")
    local.close(r)
    worker.close(s)


def test_cancel_on_receiver(shared):
    worker, local = shared
    s, r = pair(worker, local, "cr", quarantine_s=30.0)
    gen, _ = local.expect(r, "c", N, timeout_s=30, with_meta=False, peer=s)
    assert worker.post(s, r, "c", gen, SRC_IDS, DST_IDS, [0]) == [True]
    local.cancel(r, "c")
    done, ok, err, _ = local.wait("c", timeout=1)
    assert done and ok is False and err == "cancelled"
    assert local.wait_released("c", timeout=10) is not None
    assert worker.post(s, r, "c", gen, SRC_IDS, DST_IDS, [1]) == [False]
    assert local.agents[r].pending() == 0
    local.close(r)
    worker.close(s)


def test_cancel_on_sender(shared):
    worker, local = shared
    s, r = pair(worker, local, "cs", quarantine_s=30.0)
    gen, _ = local.expect(r, "c2", N, timeout_s=30, with_meta=False, peer=s)
    assert worker.post(s, r, "c2", gen, SRC_IDS, DST_IDS, [0]) == [True]
    worker.cancel(s, "c2")
    done, ok, err, _ = local.wait("c2", timeout=10)
    assert done and ok is False and err == "sender stopped"
    assert local.wait_released("c2", timeout=10) is not None
    assert worker.post(s, r, "c2", gen, SRC_IDS, DST_IDS, [1]) == [False]
    local.close(r)
    worker.close(s)


def test_late_write_after_cancel_does_not_land_in_reused_pages(shared):
    worker, local = shared
    s, r = pair(worker, local, "lw", quarantine_s=30.0)
    gen_a, _ = local.expect(r, "A", N, timeout_s=30, with_meta=False, peer=s)
    assert worker.post(s, r, "A", gen_a, SRC_IDS, DST_IDS, [0]) == [True]
    local.cancel(r, "A")
    assert local.wait_released("A", timeout=10) is not None  # only now may the pages be reused

    # Request B reuses A's destination pages with other source pages.
    src_b = [5, 4, 3]
    gen_b, _ = local.expect(r, "B", N, timeout_s=30, with_meta=False, peer=s)
    assert gen_b != gen_a
    assert worker.post(s, r, "A", gen_a, SRC_IDS, DST_IDS, range(LAYERS)) == [False] * LAYERS
    assert all(worker.post(s, r, "B", gen_b, src_b, DST_IDS, range(LAYERS)))
    assert worker.post(s, r, "A", gen_a, SRC_IDS, DST_IDS, range(LAYERS)) == [False] * LAYERS
    done, ok, err, _ = local.wait("B")
    assert done and ok, err
    time.sleep(0.3)  # any write still on its way would have landed by now
    src = from_bytes(worker.read_pools(s)[0], SRC, PAGES)
    dst = local.pools[r]
    for layer in range(LAYERS):
        for sp, dp in zip(src_b, DST_IDS):
            got = torch.cat([dst[0][layer, dp], dst[1][layer, dp]], dim=1)
            assert torch.equal(got, src[layer, sp]), f"page {dp} layer {layer} not B's data"
    local.close(r)
    worker.close(s)


def test_quarantine_holds_pages_while_sender_is_frozen(worker, local):
    s, r = pair(worker, local, "fz", quarantine_s=1.5)
    gen, _ = local.expect(r, "F", N, timeout_s=30, with_meta=False, peer=s)
    assert worker.post(s, r, "F", gen, SRC_IDS, DST_IDS, [0]) == [True]
    worker.signal(signal.SIGSTOP)  # sender alive but unresponsive: no stop confirmation
    try:
        t0 = time.monotonic()
        local.cancel(r, "F")
        cancelled = time.monotonic() - t0
        # the quarantine, not the test's pace, is what is asserted: when the pages came back,
        # measured from the cancel (a sleep here may last far longer on a loaded machine)
        released = local.wait_released("F", timeout=10)
        assert released is not None, "pages never released after the quarantine"
        assert released - t0 >= 1.4, (
            f"pages released {released - t0:.2f} s after the cancel (quarantine 1.5 s), while the sender "
            f"may still write (the cancel call took {cancelled:.2f} s)"
        )
    finally:
        worker.signal(signal.SIGCONT)
