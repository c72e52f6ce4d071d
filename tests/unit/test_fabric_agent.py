"""Two FabricAgents in one process over the fake NIXL (tests/fake_nixl.py): bytes and meta
land, and one request's lifecycle holds in every order of events -- cancel on either side
before, during and after the transfer, late (stale) and duplicate notifications, layers
landing out of order, a peer lost mid-transfer, an xfer stuck past ``xfer_timeout_s``. In
every path ``finish_send``'s callback and the receiver's ``on_done`` fire exactly once and
both agents end with ``pending() == 0`` and every NIXL handle released.

Also the notification messages (notifications.py)."""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field

import fake_nixl
import pytest
import torch
from fabric_helpers import make_pools

from fabric_bridge.agent import FabricAgent
from fabric_bridge.layout import KVLayout
from fabric_bridge.notifications import Kind, MalformedNotification, Notification, pack
from fabric_bridge.plan import build_plan, expected_writes

LAYERS = 3
SRC = KVLayout("m", LAYERS, 4, 4, 8, "float32", tp_size=1)
DST = KVLayout("m", LAYERS, 4, 4, 8, "float32", tp_size=2)  # each destination shard: half the heads
SRC_IDS, DST_IDS = [5, 0, 3], [1, 7, 4]  # deliberately out of order
N = expected_writes(SRC, DST, len(SRC_IDS))
META_FLOATS = 16


class Calls:
    """A callback that records its calls."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.times: list[float] = []
        self.event = threading.Event()

    def __call__(self, *args):
        self.calls.append(args)
        self.times.append(time.monotonic())
        self.event.set()

    def wait(self, timeout: float = 5.0) -> tuple:
        assert self.event.wait(timeout), "callback never fired"
        return self.calls[0]

    def once(self) -> tuple:
        """Fired, and exactly once (give a second call time to show up)."""
        first = self.wait()
        time.sleep(0.02)
        assert len(self.calls) == 1, self.calls
        return first


def wait_until(cond, timeout: float = 5.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


@dataclass
class Pair:
    s: FabricAgent  # sender (prefill)
    r: FabricAgent  # receiver (decode)
    s_pools: list[torch.Tensor]
    r_pools: list[torch.Tensor]
    send_errors: Calls = field(default_factory=Calls)

    def plan(self):
        return build_plan(SRC, DST, SRC_IDS, DST_IDS, random.Random(0))

    def expect(self, req="q", n=N, timeout_s=30.0, with_meta=False):
        done, released = Calls(), Calls()
        h = self.r.expect(
            req, n, on_done=done, timeout_s=timeout_s, with_meta=with_meta, peer=self.s.name, on_release=released
        )
        return h, done, released

    def post(self, req, gen, layers=range(LAYERS), plan=None):
        plan = plan or self.plan()
        return [self.s.post_layer(self.r.name, req, gen, plan, layer) for layer in layers]

    def finish(self, req="q") -> Calls:
        sent = Calls()
        self.s.finish_send(req, sent)
        return sent

    def landed(self, layers=range(LAYERS)) -> bool:
        for layer in layers:
            for sp, dp in zip(SRC_IDS, DST_IDS):  # HND page [2, heads, tokens, dim]: shards split heads
                got = torch.cat([self.r_pools[d][layer, dp] for d in range(DST.tp_size)], dim=1)
                if not torch.equal(got, self.s_pools[0][layer, sp]):
                    return False
        return True

    def settled(self) -> None:
        """Nothing left on either side, no xfer handle held."""
        wait_until(lambda: self.s.pending() == 0 and self.r.pending() == 0, what="pending() == 0")
        wait_until(lambda: fake_nixl.FABRIC.agent(self.s.name).leaks()["xfers"] == 0, what="xfers released")


@pytest.fixture
def make_pair(fabric):
    made: list[Pair] = []

    def make(quarantine_s: float = 30.0, xfer_timeout_s: float = 30.0) -> Pair:
        tag = len(made)
        s_pools, r_pools = make_pools(SRC, 6, seed=1), make_pools(DST, 8)
        errors = Calls()
        kw = dict(meta_slots=2, meta_slot_floats=META_FLOATS, quarantine_s=quarantine_s, xfer_timeout_s=xfer_timeout_s)
        s = FabricAgent(f"prefill{tag}", SRC, s_pools, on_send_error=errors, **kw)
        r = FabricAgent(f"decode{tag}", DST, r_pools, **kw)
        assert r.add_peer(s.handshake_payload()) == s.name
        assert s.add_peer(r.handshake_payload()) == r.name
        made.append(Pair(s, r, s_pools, r_pools, errors))
        return made[-1]

    yield make
    for p in made:
        for agent in (p.s, p.r):
            agent.close()
            assert fabric.agent(agent.name).leaks() == {"xfers": 0, "dlists": 0, "registrations": 0}


# ---------------------------------------------------------------- the happy path
def test_bytes_and_meta_land_and_both_sides_complete_once(make_pair):
    p = make_pair()
    h, done, released = p.expect(with_meta=True)
    assert all(p.post("q", h.generation))
    hidden, logits = torch.linspace(-1, 1, 4), torch.arange(6.0) / 7
    assert p.s.post_meta(p.r.name, "q", h.generation, h.slot, hidden, logits)
    sent = p.finish()
    assert h.wait(5), h.error
    req, ok, err, meta = done.once()
    assert (req, ok, err) == ("q", True, None)
    assert torch.equal(meta, torch.cat([hidden, logits])) and torch.equal(h.meta, meta)
    assert p.landed()
    assert sent.once() == ("q", True, None)
    p.settled()
    assert released.calls == [] and p.send_errors.calls == []
    assert p.s.stats["xfers"] == LAYERS + 1 and p.s.stats["writes"] == N + 1


def test_layers_landing_out_of_order(make_pair, fabric):
    fabric.auto = False
    p = make_pair()
    h, done, _ = p.expect()
    assert all(p.post("q", h.generation))
    sent = p.finish()
    held = list(fabric.held)
    assert len(held) == LAYERS
    fabric.complete(held[::-1][:-1])  # last layer first, then the middle one; layer 0 still held
    wait_until(lambda: p.r._tracker.counts("q") == (N - N // LAYERS, N), what="two layers counted")
    assert not h.done.is_set() and not sent.event.is_set()
    fabric.complete()
    assert h.wait(5) and done.once()[1] is True and p.landed()
    assert sent.once() == ("q", True, None)
    p.settled()


def test_layers_and_meta_landing_shuffled(make_pair, fabric):
    fabric.auto = False
    p = make_pair()
    h, done, _ = p.expect(with_meta=True)
    assert all(p.post("q", h.generation))
    assert p.s.post_meta(p.r.name, "q", h.generation, h.slot, torch.ones(2), torch.zeros(3))
    sent = p.finish()
    assert fabric.complete(shuffle=random.Random(7)) == LAYERS + 1
    assert h.wait(5) and done.once()[3].tolist() == [1, 1, 0, 0, 0]
    assert sent.once() == ("q", True, None) and p.landed()
    p.settled()


# ---------------------------------------------------------------- cancel, receiver side
def test_receiver_cancel_before_any_post(make_pair):
    p = make_pair()
    h, done, released = p.expect()
    p.r.cancel("q")
    assert done.once()[1:3] == (False, "cancelled")
    assert released.once() == ("q", h.generation)  # the sender confirmed at once: nothing posted
    assert p.post("q", h.generation) == [False] * LAYERS
    assert p.finish().once() == ("q", False, "cancelled by receiver")
    p.settled()
    assert p.s.stats["xfers"] == 0


def test_receiver_cancel_with_writes_in_flight(make_pair, fabric):
    fabric.auto = False
    p = make_pair()
    h, done, released = p.expect()
    assert p.post("q", h.generation, [0]) == [True]
    p.r.cancel("q")
    assert done.once()[1:3] == (False, "cancelled")
    wait_until(lambda: p.post("q", h.generation, [1]) == [False], what="the sender to stop")
    sent = p.finish()
    time.sleep(0.05)
    assert not released.event.is_set(), "pages released while a write is in flight"
    assert not sent.event.is_set(), "finish_send fired with a write in flight"
    fabric.complete()  # the late write lands (in quarantined pages), then the sender confirms
    assert released.once() == ("q", h.generation)
    assert sent.once() == ("q", False, "cancelled by receiver")
    p.settled()


def test_receiver_cancel_after_completion_changes_nothing(make_pair, fabric):
    p = make_pair()
    h, done, released = p.expect()
    assert all(p.post("q", h.generation))
    sent = p.finish()
    assert h.wait(5)
    p.r.cancel("q")
    assert done.once()[1] is True and sent.once() == ("q", True, None)
    p.settled()
    assert released.calls == [] and h.ok


# ---------------------------------------------------------------- cancel, sender side
def test_sender_cancel_before_any_post_tells_the_receiver(make_pair):
    p = make_pair()
    h, done, released = p.expect()
    p.s.cancel("q", "prefill aborted", p.r.name, h.generation)
    assert done.once()[1:3] == (False, "sender stopped")
    assert released.once() == ("q", h.generation)
    assert p.post("q", h.generation) == [False] * LAYERS
    assert p.finish().once() == ("q", False, "prefill aborted")
    p.settled()


def test_sender_cancel_with_writes_in_flight(make_pair, fabric):
    fabric.auto = False
    p = make_pair()
    h, done, released = p.expect()
    assert p.post("q", h.generation, [0, 1]) == [True, True]
    sent = p.finish()
    p.s.cancel("q", "prefill aborted", p.r.name, h.generation)
    assert p.post("q", h.generation, [2]) == [False]
    time.sleep(0.05)
    assert not done.event.is_set() and not sent.event.is_set()
    fabric.complete()
    assert done.once()[1:3] == (False, "sender stopped")  # S only after both writes are done
    assert released.once() == ("q", h.generation)
    assert sent.once() == ("q", False, "prefill aborted")
    p.settled()


def test_sender_cancel_after_completion_changes_nothing(make_pair):
    p = make_pair()
    h, done, released = p.expect()
    assert all(p.post("q", h.generation))
    sent = p.finish()
    assert h.wait(5) and sent.once() == ("q", True, None)
    p.s.cancel("q", "too late", p.r.name, h.generation)
    assert done.once()[1] is True
    p.settled()
    assert released.calls == [] and len(sent.calls) == 1


# ---------------------------------------------------------------- late and duplicate notifications
def test_a_notification_after_cancel_is_stale_for_the_next_generation(make_pair, fabric):
    fabric.auto = False
    p = make_pair()
    old, old_done, old_released = p.expect()
    assert p.post("q", old.generation, [0]) == [True]
    p.r.cancel("q")
    new, new_done, _ = p.expect()  # the request is expected again: a new generation
    assert new.generation != old.generation
    fabric.complete()  # the cancelled generation's write lands late, then the sender confirms
    assert old_released.once() == ("q", old.generation)
    assert p.r._tracker.counts("q") == (0, N)  # nothing of the old generation counted
    fabric.auto = True
    assert all(p.post("q", new.generation))
    assert p.finish().once() == ("q", True, None)
    assert new.wait(5) and new_done.once()[1] is True and p.landed()
    assert old_done.once()[1] is False
    p.settled()


def test_a_stale_write_notification_is_ignored(make_pair, fabric):
    p = make_pair()
    h, done, _ = p.expect()
    s_nixl = fabric.agent(p.s.name)
    s_nixl.send_notif(p.r.name, pack(Kind.WRITES_LANDED, h.generation + 100, N, "q"))  # another generation
    time.sleep(0.02)
    assert p.r._tracker.counts("q") == (0, N) and not h.done.is_set()
    assert all(p.post("q", h.generation))
    assert p.finish().once() == ("q", True, None)
    assert h.wait(5) and done.once()[1] is True
    p.settled()


def test_duplicate_notifications_fire_callbacks_once(make_pair, fabric):
    fabric.notif_filter = lambda sender, target, msg: [msg, msg]
    p = make_pair()
    h, done, released = p.expect()
    assert all(p.post("q", h.generation))
    sent = p.finish()
    assert h.wait(5) and done.once()[1] is True and sent.once()[1] is True
    # and the stop/confirm exchange of a cancelled request: X and S both arrive twice
    fabric.auto = False
    h2, done2, released2 = p.expect("c")
    assert p.post("c", h2.generation, [0]) == [True]
    p.r.cancel("c")
    wait_until(lambda: p.post("c", h2.generation, [1]) == [False], what="the sender to stop")
    sent2 = p.finish("c")
    fabric.complete()
    assert released2.once() == ("c", h2.generation) and done2.once()[1] is False
    assert sent2.once() == ("c", False, "cancelled by receiver")
    p.settled()
    assert released.calls == []


def test_malformed_notification_is_logged_and_dropped(make_pair, fabric, caplog):
    p = make_pair()
    h, done, _ = p.expect()
    with caplog.at_level(logging.WARNING, logger="triton_disagg.fabric"):
        fabric.agent(p.s.name).send_notif(p.r.name, b"W:not-a-number:3:q")
        wait_until(lambda: "malformed notification" in caplog.text, what="the warning")
    assert all(p.post("q", h.generation))
    assert p.finish().once() == ("q", True, None)
    assert h.wait(5) and done.once()[1] is True
    p.settled()


# ---------------------------------------------------------------- failures
def test_receiver_lost_mid_transfer_fails_the_send_once(make_pair, fabric):
    fabric.auto = False
    p = make_pair()
    h, _, _ = p.expect()
    assert p.post("q", h.generation, [0]) == [True]
    sent = p.finish()
    fabric.kill(p.r.name)
    req, ok, err = sent.once()
    assert (req, ok) == ("q", False) and "nixlRemoteDisconnectError" in err
    assert p.send_errors.once()[:2] == ("q", h.generation)
    assert p.post("q", h.generation, [1, 2]) == [False, False]  # must not raise or hang
    wait_until(lambda: p.s.pending() == 0)
    assert fabric.agent(p.s.name).leaks()["xfers"] == 0


def test_receiver_lost_before_a_post(make_pair, fabric):
    p = make_pair()
    h, _, _ = p.expect()
    fabric.kill(p.r.name)
    assert p.post("q", h.generation, [0]) == [False]  # transfer() raised: the request failed
    assert "posting to" in p.send_errors.once()[2]
    assert p.finish().once()[:2] == ("q", False)
    wait_until(lambda: p.s.pending() == 0)


def test_sender_lost_mid_transfer_times_out_then_quarantine_ends(make_pair, fabric):
    fabric.auto = False
    p = make_pair(quarantine_s=0.2)
    h, done, released = p.expect(timeout_s=0.3)
    assert p.post("q", h.generation, [0]) == [True]
    fabric.complete()
    fabric.kill(p.s.name)  # layer 0 landed, the rest never comes; nobody confirms the stop
    req, ok, err, _ = done.once()
    assert not ok and err.startswith(f"timeout (transfer): {N // LAYERS}/{N} writes")
    assert released.once() == ("q", h.generation)
    assert released.times[0] - done.times[0] >= 0.19  # the whole quarantine: nobody confirmed
    wait_until(lambda: p.r.pending() == 0)


def test_xfer_in_error_fails_the_request(make_pair, fabric):
    fabric.auto = False
    p = make_pair()
    h, done, released = p.expect()
    assert p.post("q", h.generation, [0, 1]) == [True, True]
    sent = p.finish()
    fabric.fail(fabric.held[:1])
    assert p.send_errors.once()[2].endswith("ERR state")
    time.sleep(0.02)
    assert not sent.event.is_set()  # the second write is still in flight
    fabric.complete()
    assert sent.once()[:2] == ("q", False)
    assert done.once()[1:3] == (False, "sender stopped") and released.once() == ("q", h.generation)
    p.settled()


def test_transfer_refused_at_post(make_pair, fabric):
    fabric.fail_posts = True
    p = make_pair()
    h, done, _ = p.expect()
    assert p.post("q", h.generation, [0, 1]) == [False, False]
    assert "failed at post (ERR)" in p.send_errors.once()[2]
    assert p.finish().once()[:2] == ("q", False)
    assert done.once()[1:3] == (False, "sender stopped")
    p.settled()


def test_xfer_stuck_past_xfer_timeout_is_aborted(make_pair, fabric):
    fabric.auto = False
    p = make_pair(xfer_timeout_s=0.2)
    h, done, released = p.expect()
    assert p.post("q", h.generation, [0]) == [True]
    sent = p.finish()
    req, ok, err = sent.once()
    assert not ok and "still in progress after 0.2s" in err
    assert p.send_errors.once()[2] == err
    assert fabric.held == []  # aborted: it never lands
    assert done.once()[1:3] == (False, "sender stopped") and released.once() == ("q", h.generation)
    p.settled()


def test_a_stuck_xfer_that_cannot_be_aborted_keeps_the_request_until_it_ends(make_pair, fabric):
    fabric.auto, fabric.abort_fails = False, True
    p = make_pair(xfer_timeout_s=0.1)
    h, done, released = p.expect()
    assert p.post("q", h.generation, [0]) == [True]
    sent = p.finish()
    p.send_errors.wait()  # timed out...
    time.sleep(0.1)
    assert not sent.event.is_set() and p.s.pending() == 1  # ...but still in flight: pages held
    assert not released.event.is_set()
    fabric.complete()
    assert sent.once()[:2] == ("q", False) and len(p.send_errors.calls) == 1
    assert released.once() == ("q", h.generation)
    p.settled()


# ---------------------------------------------------------------- notifications
@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("req_id", ["r1", "cmpl-a:b:c", "é-42"])
def test_notification_round_trip(kind, req_id):
    n = Notification(kind, 12, 0 if kind in (Kind.SENDER_STOPPED, Kind.CANCELLED_BY_RECEIVER) else 96, req_id)
    data = n.encode()
    assert Notification.decode(data) == n and pack(n.kind, n.generation, n.count, n.req_id) == data
    assert data.startswith(kind.value.encode() + b":12:")


def test_wire_format_is_unchanged():
    assert Notification(Kind.WRITES_LANDED, 3, 40, "req").encode() == b"W:3:40:req"
    assert Notification.decode(b"S:7:0:x") == Notification(Kind.SENDER_STOPPED, 7, 0, "x")


@pytest.mark.parametrize(
    "data",
    [b"", b"W", b"W:1:2", b"Q:1:2:r", b"w:1:2:r", b"W:x:2:r", b"W:-1:2:r", b"W:1:+2:r", b"W: 1:2:r", b"W:1_0:2:r"]
    + [b"W:1:2:", b"\xff\xfe:1:2:r", "W:1:2:r", None],
)
def test_malformed_notification_is_refused(data):
    with pytest.raises(MalformedNotification):
        Notification.decode(data)
    assert issubclass(MalformedNotification, ValueError)
