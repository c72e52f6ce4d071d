"""Cluster membership against real etcd processes (backend/cluster/, backend/launch/etcd_server.py):
registrations seen by a watching Membership, deregistration at once, a dead registrant's record
gone with its lease, forged and refused records ignored (logged once), a lost lease re-taken,
and an etcd killed and restarted without any member being cut. About 25 s."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backend.cluster.etcd import EtcdClient, EtcdUnavailable
from backend.cluster.membership import Membership, Registration
from backend.cluster.records import InstanceRecord, encode, key_of, prefix_of
from backend.launch.etcd_server import EtcdServer, etcd_binary
from backend.launch.ports import free_port

# etcd is part of the setup (scripts/setup.sh installs Debian's etcd-server): its absence fails here
assert etcd_binary() is not None, "etcd is not installed: run scripts/setup.sh as root (Debian's etcd-server)"

ROOT = Path(__file__).resolve().parents[2]
SECRET = "cluster-test-secret-0123456789abcdef"
TTL = 2.0
LOGGER = "triton_disagg.membership"


def make_record(deployment: str, name: str, role: str, **kw) -> InstanceRecord:
    fields = dict(
        deployment=deployment,
        name=name,
        role=role,
        grpc_url="127.0.0.1:8001",
        model=f"{role}_0",
        messenger="127.0.0.1:7000" if role == "prefill" else "",
        model_identity="smollm2-135m:q8",
        kv_layout="hnd-p16",
        tp_size=1,
        started_at=time.time(),
    )
    fields.update(kw)
    return InstanceRecord(**fields)


class Changes:
    """Every on_change call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[InstanceRecord], list[InstanceRecord]]] = []
        self.lock = threading.Lock()

    def __call__(self, joined, left) -> None:
        with self.lock:
            self.calls.append((list(joined), list(left)))

    def joined(self) -> list[InstanceRecord]:
        with self.lock:
            return [r for j, _ in self.calls for r in j]

    def left(self) -> list[InstanceRecord]:
        with self.lock:
            return [r for _, lf in self.calls for r in lf]


def names(members) -> set[str]:
    return {r.name for r in members}


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("etcd")
    server = EtcdServer(data_dir=tmp / "data", log_file=tmp / "etcd.log")
    try:
        server.start()
        yield server
    finally:
        server.stop()
        print(f"etcd log: {server.log_file}")


@pytest.fixture
def client(etcd) -> EtcdClient:
    return EtcdClient(etcd.url)


def test_unreachable_etcd_names_its_url():
    url = f"etcd://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(EtcdUnavailable, match=url):
        EtcdClient(url).get_prefix("/triton-disagg/")
    assert time.monotonic() - started < 3
    with pytest.raises(ValueError, match="etcd://HOST:PORT"):
        EtcdClient("grpc://127.0.0.1:2379")


def test_registrations_seen_updated_and_deregistered(client, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    changes = Changes()
    membership = Membership(client, "dep-join", SECRET, on_change=changes, grace_s=2 * TTL)
    prefill = Registration(client, make_record("dep-join", "h:prefill_0:1", "prefill"), SECRET, ttl_s=TTL).start()
    decode = Registration(client, make_record("dep-join", "h:decode_0:2", "decode"), SECRET, ttl_s=TTL).start()
    try:
        assert membership.wait_for(lambda m: len(m) == 2, 5), membership.members()
        assert membership.connected
        assert set(changes.joined()) == {prefill.record, decode.record}
        assert membership.members("prefill") == [prefill.record]
        assert membership.members("decode") == [decode.record]
        assert any("registered /triton-disagg/dep-join/instances/prefill/h:prefill_0:1" in m for m in caplog.messages)

        draining = decode.update(draining=True)
        assert membership.wait_for(lambda m: draining in m, 3)
        assert changes.joined()[-1] == draining

        started = time.monotonic()
        prefill.close()
        assert membership.wait_for(lambda m: names(m) == {"h:decode_0:2"}, 1.5)
        assert time.monotonic() - started < 1.0, "a closed registration must leave at once, not with its lease"
        assert changes.left() == [prefill.record]
        assert any(m.startswith("deregistered /triton-disagg/dep-join/") for m in caplog.messages)
    finally:
        prefill.close()
        decode.close()
        started = time.monotonic()
        membership.close()
        assert time.monotonic() - started < 1.5, "Membership.close() must stop its watch promptly"


def test_a_followed_state_is_written_when_it_changes_and_only_then(client, caplog):
    """A decode instance's health and cache summary travel in its record: ``follow`` writes the
    record again when ``fields()`` changed (watchers see it), a change of health at once, any
    other at most every ``interval_s``, and nothing when nothing changed; a ``fields()`` that
    raises is logged once and the record stays as it was."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    changes = Changes()
    membership = Membership(client, "dep-state", SECRET, on_change=changes, grace_s=2 * TTL)
    state = {"health": "no prefill instance connected", "cache": ""}
    broken = threading.Event()

    def fields() -> dict[str, str]:
        if broken.is_set():
            raise RuntimeError("the engine is gone")
        return dict(state)

    decode = Registration(client, make_record("dep-state", "h:decode_0:3", "decode", **state), SECRET, ttl_s=TTL)
    decode.start()
    decode.follow(fields, 1.5, at_once=("health",))
    try:
        assert membership.wait_for(lambda m: len(m) == 1, 5)
        time.sleep(0.5)  # several looks, nothing changed: no write
        assert len(changes.joined()) == 1
        state.update(health="", cache='{"version": 2}')  # health changed: written at once, both fields
        assert membership.wait_for(lambda m: m and m[0].health == "" and m[0].cache == '{"version": 2}', 1.0)
        assert len(changes.joined()) == 2
        state.update(cache='{"version": 3}')  # the cache alone: not before 1.5 s after the last write
        time.sleep(0.5)
        assert membership.members()[0].cache == '{"version": 2}'
        assert membership.wait_for(lambda m: m and m[0].cache == '{"version": 3}', 3)
        broken.set()
        time.sleep(0.3)
        assert sum("could not take the state of" in m for m in caplog.messages) == 1
        assert membership.members()[0].health == ""
        broken.clear()
        state.update(health="lost tensor-parallel rank 1")
        assert membership.wait_for(lambda m: m and m[0].health == "lost tensor-parallel rank 1", 1.0)
    finally:
        decode.close()
        membership.close()


CHILD = """
import os, sys, time
from backend.cluster.etcd import EtcdClient
from backend.cluster.membership import Registration
from backend.cluster.records import InstanceRecord
url, secret, deployment, ttl = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
record = InstanceRecord(deployment=deployment, name=f"child:decode_0:{os.getpid()}", role="decode",
                        grpc_url="127.0.0.1:8001", model="decode_0", messenger="", model_identity="m",
                        kv_layout="k", tp_size=1, started_at=time.time())
registration = Registration(EtcdClient(url), record, secret, ttl_s=ttl).start()
while not registration.registered:
    time.sleep(0.05)
print("registered", record.name, flush=True)
time.sleep(600)
"""


def test_dead_registrant_leaves_after_its_ttl(client):
    changes = Changes()
    membership = Membership(client, "dep-dead", SECRET, on_change=changes, grace_s=2 * TTL)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, client.url, SECRET, "dep-dead", str(TTL)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.startswith("registered"), line
        name = line.split()[1]
        assert membership.wait_for(lambda m: names(m) == {name}, 5)
        time.sleep(TTL)  # it keeps its lease alive while it runs
        assert names(membership.members()) == {name}
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        killed = time.monotonic()
        assert membership.wait_for(lambda m: not m, TTL + 3), "the dead instance's record outlived its lease"
        gone_after = time.monotonic() - killed
        assert 0.3 < gone_after < TTL + 2.5, gone_after
        assert [r.name for r in changes.left()] == [name]
        print(f"dead registrant left {gone_after:.2f} s after SIGKILL (ttl {TTL} s)")
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        membership.close()


def test_forged_and_refused_records_are_ignored(client, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    dep = "dep-forged"
    forged = make_record(dep, "evil:decode_0:1", "decode", grpc_url="6.6.6.6:8001")
    forged_key = key_of(forged)
    client.put(forged_key, encode(forged, "not-the-deployment-secret-at-all"))
    client.put(prefix_of(dep, "decode") + "garbage", b"{not json")
    accept = lambda r: None if r.model_identity == "smollm2-135m:q8" else f"model identity {r.model_identity} differs"
    changes = Changes()
    membership = Membership(client, dep, SECRET, accept=accept, on_change=changes, grace_s=2 * TTL)
    good = Registration(client, make_record(dep, "h:decode_0:1", "decode"), SECRET, ttl_s=TTL).start()
    other = Registration(
        client, make_record(dep, "h:decode_1:2", "decode", model_identity="llama-1b:bf16"), SECRET, ttl_s=TTL
    ).start()
    try:
        assert membership.wait_for(lambda m: names(m) == {"h:decode_0:1"}, 5)
        # the same forged value written again is not logged again; a new one is
        client.put(forged_key, encode(forged, "not-the-deployment-secret-at-all"))
        client.put(prefix_of(dep, "decode") + "late-forgery", encode(forged, "yet-another-wrong-secret-value"))
        other.update(tp_size=2)  # still refused
        sentinel = Registration(client, make_record(dep, "h:decode_2:3", "decode"), SECRET, ttl_s=TTL).start()
        try:
            assert membership.wait_for(lambda m: "h:decode_2:3" in names(m), 5)  # the events above came first
        finally:
            sentinel.close()
        assert membership.wait_for(lambda m: names(m) == {"h:decode_0:1"}, 3)
        assert "evil:decode_0:1" not in names(changes.joined())
        assert "h:decode_1:2" not in names(changes.joined())

        def logged(*words):
            return [m for m in caplog.messages if all(w in m for w in words)]

        assert len(logged(forged_key, "wrong signature")) == 1, caplog.messages
        assert len(logged("garbage", "malformed JSON")) == 1, caplog.messages
        assert len(logged("late-forgery", "wrong signature")) == 1, caplog.messages
        refusals = logged("h:decode_1:2", "model identity llama-1b:bf16 differs")
        assert len(refusals) == 2, caplog.messages  # once per value: the update changed it
    finally:
        good.close()
        other.close()
        membership.close()
        client.delete(forged_key)


def test_registration_takes_a_new_lease_when_its_lease_is_gone(client, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    registration = Registration(client, make_record("dep-lease", "h:prefill_0:1", "prefill"), SECRET, ttl_s=TTL)
    registration.start()
    try:
        first = registration.lease_id
        assert first is not None
        client.revoke(first)  # as if it had lapsed
        deadline = time.monotonic() + 3 * TTL
        while time.monotonic() < deadline and registration.lease_id in (None, first):
            time.sleep(0.05)
        assert registration.lease_id not in (None, first)
        _, kvs = client.get_prefix(prefix_of("dep-lease"))
        assert list(kvs) == [registration.key]
        assert any(m.startswith("re-registered /triton-disagg/dep-lease/") for m in caplog.messages)
    finally:
        registration.close()


def test_etcd_outage_cuts_no_member(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    server = EtcdServer(data_dir=tmp_path / "data", log_file=tmp_path / "etcd.log")
    server.start()
    client = EtcdClient(server.url)
    dep = "dep-outage"
    client.put(key_of(make_record(dep, "evil:decode_9:1", "decode")), b'{"v": 1}')  # logged once, not per re-list
    changes = Changes()
    membership = Membership(client, dep, SECRET, on_change=changes, grace_s=2 * TTL)
    regs = [
        Registration(client, make_record(dep, "h:prefill_0:1", "prefill"), SECRET, ttl_s=TTL).start(),
        Registration(client, make_record(dep, "h:decode_0:2", "decode"), SECRET, ttl_s=TTL).start(),
    ]
    late: Registration | None = None
    try:
        assert membership.wait_for(lambda m: len(m) == 2, 5)
        before = set(membership.members())

        server.kill()
        down = time.monotonic()
        deadline = down + 3
        while membership.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not membership.connected
        late = Registration(client, make_record(dep, "h:decode_1:3", "decode"), SECRET, ttl_s=TTL).start()
        assert not late.registered
        while time.monotonic() - down < 5:  # the outage: nothing leaves
            assert set(membership.members()) == before
            time.sleep(0.1)

        server.start()
        assert membership.wait_for(lambda m: len(m) == 3, 10), membership.members()
        assert membership.connected
        _, kvs = client.get_prefix(prefix_of(dep))
        assert {r.key for r in regs} | {late.key} <= set(kvs)
        time.sleep(2 * TTL + 1)  # past the grace: still nobody cut
        assert names(membership.members()) == {"h:prefill_0:1", "h:decode_0:2", "h:decode_1:3"}
        assert all(r.registered for r in [*regs, late])
        assert changes.left() == [], changes.calls
        assert names(changes.joined()) == {"h:prefill_0:1", "h:decode_0:2", "h:decode_1:3"}
        assert len([m for m in caplog.messages if "evil:decode_9:1" in m]) == 1, caplog.messages
        assert any("etcd unreachable" in m for m in caplog.messages)
        assert any("answers again" in m for m in caplog.messages)
    finally:
        for r in [*regs, *([late] if late else [])]:
            r.close(timeout_s=1.0)
        membership.close()
        server.stop()
        print(f"etcd log: {server.log_file}")


def test_etcd_back_without_its_store_members_register_again_within_the_grace(tmp_path, caplog):
    """etcd comes back empty (a new data directory on the same ports): the live registrations
    find their leases gone and register again before the grace ends, so they are never cut; an
    instance that died during the outage leaves once the grace is over."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    server = EtcdServer(data_dir=tmp_path / "data", log_file=tmp_path / "etcd.log")
    server.start()
    client = EtcdClient(server.url)
    dep = "dep-lost"
    changes = Changes()
    # the membership retries faster than the registrations (every 1 s at ttl 3 s), so that it
    # most likely lists the empty store first and the grace is what keeps the live members
    membership = Membership(client, dep, SECRET, on_change=changes, grace_s=2 * TTL, retry_s=0.1)
    live = [
        Registration(client, make_record(dep, "h:prefill_0:1", "prefill"), SECRET, ttl_s=3.0).start(),
        Registration(client, make_record(dep, "h:decode_0:2", "decode"), SECRET, ttl_s=3.0).start(),
    ]
    dead = Registration(client, make_record(dep, "h:decode_1:3", "decode"), SECRET, ttl_s=TTL).start()
    fresh: EtcdServer | None = None
    try:
        assert membership.wait_for(lambda m: len(m) == 3, 5)
        server.kill()
        deadline = time.monotonic() + 3
        while membership.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not membership.connected
        dead.close(revoke=False)  # dies during the outage
        time.sleep(1.0)
        fresh = EtcdServer(
            data_dir=tmp_path / "data2",
            client_port=server.client_port,
            peer_port=server.peer_port,
            log_file=tmp_path / "etcd2.log",
        )
        fresh.start()
        back = time.monotonic()
        assert membership.wait_for(lambda m: names(m) == {"h:prefill_0:1", "h:decode_0:2"}, 2 * TTL + 3)
        left_after = time.monotonic() - back
        assert left_after > 2 * TTL - 0.5, f"the dead instance left {left_after:.2f} s after etcd came back"
        assert names(changes.left()) == {"h:decode_1:3"}, changes.calls
        assert all(r.registered for r in live)
        _, kvs = client.get_prefix(prefix_of(dep))
        assert set(kvs) == {r.key for r in live}
        assert sum("re-registered" in m for m in caplog.messages) == 2, caplog.messages
        relisted = [m for m in caplog.messages if "answers again:" in m]
        assert relisted and "member(s) missing" in relisted[0], caplog.messages
        print(f"first listing after the restart: {relisted[0]}")
    finally:
        for r in live:
            r.close(timeout_s=1.0)
        membership.close()
        server.stop()
        if fresh is not None:
            fresh.stop()
        print(f"etcd logs: {server.log_file}, {tmp_path / 'etcd2.log'}")


def test_a_drain_request_travels_through_etcd_apart_from_the_models_inputs(client, caplog):
    """``triton-disagg drain``'s path (``backend/launch/drain.py`` -> the instance's drain key ->
    ``backend/serving/drain.py`` ``DrainRequests``): a forged or stale request is refused and
    logged, a valid one drains once and the CLI sees the record say so; an instance that refuses
    makes the CLI fail with why."""
    from backend.launch.drain import drain
    from backend.serving.drain import DrainRequests, drain_key, drain_request

    record = make_record("drains", "host-decode_1-42", "decode")
    drained: list[str] = []
    with Registration(client, record, SECRET, ttl_s=TTL) as reg:

        def on_drain() -> None:
            drained.append(record.name)
            reg.update(draining=True)

        watch = DrainRequests(client, "drains", record.name, SECRET.encode(), on_drain)
        key = drain_key("drains", record.name)
        try:
            with caplog.at_level(logging.WARNING, logger="triton_disagg.drain"):
                # one at a time: the key holds one request, and a second put before the watch
                # has read the first replaces it (only the latest request counts)
                forged = drain_request(b"not-the-deployment-secret", record.name)
                stale = drain_request(SECRET.encode(), record.name, now=time.time() - 3600)
                for refusals, request in enumerate((forged, stale), start=1):
                    client.put(key, request.encode())
                    deadline = time.monotonic() + 30
                    while client.get_prefix(key)[1] or caplog.text.count("drain request refused") < refusals:
                        assert time.monotonic() < deadline, (client.get_prefix(key), caplog.text)
                        time.sleep(0.05)
            assert drained == [] and "does not prove the deployment secret" in caplog.text and "old" in caplog.text
            drain(client.url, record, SECRET.encode(), timeout_s=5)  # returns once the record says draining
            assert drained == [record.name] and not client.get_prefix(key)[1]
            client.put(key, drain_request(SECRET.encode(), record.name).encode())  # again: acknowledged, once
            time.sleep(0.5)
            assert drained == [record.name] and not client.get_prefix(key)[1]
        finally:
            watch.close()
    other = make_record("drains", "host-decode_2-43", "decode")
    with Registration(client, other, SECRET, ttl_s=TTL):
        refusing = DrainRequests(client, "drains", other.name, b"another-secret-0123456789abcdef", lambda: None)
        try:
            with pytest.raises(RuntimeError, match="did not drain within 1s: it refused the request"):
                drain(client.url, other, SECRET.encode(), timeout_s=1)
        finally:
            refusing.close()
