"""Cluster membership over etcd: an instance's ``Registration`` (its signed record under a lease
it keeps alive) and a router's ``Membership`` (the verified records of a deployment, kept
current by a list-then-watch loop).

Failure model:

* An instance that dies stops renewing its lease; etcd deletes its record when the lease expires
  (about ``ttl_s`` later) and every watcher sees the delete at once. ``Registration.close()``
  revokes the lease: the record goes at once.
* etcd unreachable: registrations retry quietly (one log line per outage) and, when etcd is back
  and their lease is gone, take a new lease and write their record again. A ``Membership`` keeps
  its last known members for the whole outage (nothing leaves); once etcd answers again it
  re-lists, and a member missing from that listing leaves only if it is still missing
  ``grace_s`` later, so instances whose leases lapsed during the outage and that register again
  promptly are never cut. A delete seen on a live watch removes at once.
* Records that fail verification (forged, altered, malformed, under another key) and records
  that ``accept`` refuses (another model identity or KV layout, say) are ignored, each logged
  once per key and value.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from backend.cluster.etcd import EtcdClient, EtcdError, EtcdUnavailable, WatchEvent
from backend.cluster.records import BadRecord, InstanceRecord, decode, encode, key_of, prefix_of, secret_bytes

log = logging.getLogger("triton_disagg.membership")

Accept = Callable[[InstanceRecord], "str | None"]
OnChange = Callable[[list[InstanceRecord], list[InstanceRecord]], None]
FOLLOW_POLL_S = 0.1  # how often a followed record's fields are looked at (Registration.follow)


class Registration:
    """This instance's record in etcd, under a lease kept alive by a daemon thread (every
    ``ttl_s / 3``). ``start()`` never fails because etcd is down: the thread registers once it
    answers."""

    def __init__(self, client: EtcdClient, record: InstanceRecord, secret: bytes | str, ttl_s: float = 5.0) -> None:
        if ttl_s < 1:
            raise ValueError(f"ttl_s {ttl_s} must be at least 1 s (etcd leases count whole seconds)")
        self.client = client
        self.ttl_s = ttl_s
        self._secret = secret_bytes(secret)
        encode(record, self._secret)  # refuse a record that watchers would refuse
        self._record = record
        self.key = key_of(record)
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._dirty = True  # the record in etcd is not (known to be) the current one
        self._registrations = 0
        self._outage = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def record(self) -> InstanceRecord:
        return self._record

    @property
    def lease_id(self) -> int | None:
        return self._lease

    @property
    def registered(self) -> bool:
        """True while the current record is in etcd under a live lease (as of the last round)."""
        return self._lease is not None and not self._dirty

    def start(self) -> Registration:
        if self._thread is not None:
            raise RuntimeError(f"registration of {self.key} already started")
        self._round()
        self._thread = threading.Thread(target=self._run, name=f"etcd-registration-{self._record.name}", daemon=True)
        self._thread.start()
        return self

    def update(self, **changes: Any) -> InstanceRecord:
        """Change fields of the record (``draining=True``, say) and write it again now (or, etcd
        being down, as soon as it is back). The key fields (deployment, role, name) stay."""
        for field in ("deployment", "role", "name"):
            if field in changes and changes[field] != getattr(self._record, field):
                raise ValueError(f"update cannot change {field}: it is part of the key {self.key}")
        record = dataclasses.replace(self._record, **changes)
        encode(record, self._secret)
        with self._lock:
            self._record = record
            self._dirty = True
        self._round()
        return record

    def follow(self, fields: Callable[[], dict[str, Any]], interval_s: float, at_once: Iterable[str] = ()) -> None:
        """Keep fields of the record current (a decode instance's health and cache summary): on
        a thread of its own until ``close()``, look at ``fields()`` every ``FOLLOW_POLL_S`` and
        write the record again when they changed: at once for a change of a field in
        ``at_once``, else at most every ``interval_s``. A ``fields()`` that raises is logged
        (once until it works again) and asked again next time."""
        prompt = frozenset(at_once)

        def run() -> None:
            failing, written = False, -math.inf
            while not self._stop.wait(min(FOLLOW_POLL_S, interval_s)):
                try:
                    changes = {k: v for k, v in fields().items() if getattr(self._record, k) != v}
                    if changes and (prompt & set(changes) or time.monotonic() - written >= interval_s):
                        self.update(**changes)
                        written = time.monotonic()
                    failing = False
                except Exception:
                    if not failing:
                        log.exception("could not take the state of %s for its record", self.key)
                    failing = True

        threading.Thread(target=run, name=f"etcd-state-{self._record.name}", daemon=True).start()

    def close(self, revoke: bool = True, timeout_s: float = 2.0) -> None:
        """Stop keeping the lease alive and (``revoke``) revoke it, which deletes the record at
        once; best effort within ``timeout_s``. ``revoke=False`` leaves the record to expire
        with its lease, as if this process had died."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        with self._lock:
            lease, self._lease = self._lease, None
        if not revoke or lease is None:
            return
        try:
            EtcdClient(self.client.url, timeout_s=timeout_s).revoke(lease)
            log.info("deregistered %s from etcd at %s (lease %x revoked)", self.key, self.client.url, lease)
        except EtcdError as e:
            log.warning(
                "could not deregister %s from etcd at %s (it expires with its lease): %s", self.key, self.client.url, e
            )

    def __enter__(self) -> Registration:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while True:
            period = self.ttl_s / 3 if not self._outage else min(self.ttl_s / 3, 1.0)
            if self._stop.wait(period):
                return
            self._round()

    def _round(self) -> None:
        """Register when there is no lease, else keep the lease alive (and write the record when
        it changed); a lease found gone means registering again."""
        try:
            with self._lock:
                if self._stop.is_set():
                    return
                if self._lease is not None:
                    if self.client.keepalive(self._lease) <= 0:
                        log.warning("the lease of %s in etcd at %s expired", self.key, self.client.url)
                        self._lease = None
                        self._dirty = True
                    elif self._dirty:
                        self.client.put(self.key, encode(self._record, self._secret), lease=self._lease)
                        self._dirty = False
                if self._lease is None:
                    self._register()
            if self._outage:
                self._outage = False
                log.info("etcd at %s answers again (%s registered)", self.client.url, self.key)
        except EtcdUnavailable as e:
            if not self._outage:
                self._outage = True
                again = " again" if self._registrations else ""
                log.warning("etcd unreachable; %s will register%s once it answers: %s", self.key, again, e)
        except EtcdError as e:
            # e.g. the lease expired between the keep-alive and the put: start over next round
            log.warning("registration of %s in etcd at %s failed, retrying: %s", self.key, self.client.url, e)
            with self._lock:
                self._lease = None
                self._dirty = True

    def _register(self) -> None:
        lease = self.client.grant(self.ttl_s)
        self.client.put(self.key, encode(self._record, self._secret), lease=lease)
        self._lease = lease
        self._dirty = False
        self._registrations += 1
        word = "registered" if self._registrations == 1 else "re-registered"
        log.info("%s %s in etcd at %s (lease %x, ttl %g s)", word, self.key, self.client.url, lease, self.ttl_s)


class Membership:
    """The verified records under a deployment's prefix (one role's, with ``role``), kept from a
    daemon thread: list, then watch from the next revision; re-list after any break.

    ``accept(record)`` returns None to take a record or a reason to ignore it. ``on_change(joined,
    left)`` is called from the membership's threads, one call at a time, after each change:
    ``joined`` holds the records new or changed (a record written again with ``draining=True``
    comes back in ``joined``), ``left`` the records gone. ``grace_s`` (default 10 s, twice the
    default TTL): how long a member missing from a re-listing after an outage or a broken watch
    stays before it leaves."""

    def __init__(
        self,
        client: EtcdClient,
        deployment: str,
        secret: bytes | str,
        role: str | None = None,
        accept: Accept | None = None,
        on_change: OnChange | None = None,
        grace_s: float = 10.0,
        retry_s: float = 0.5,
    ) -> None:
        self.client = client
        self.deployment = deployment
        self.prefix = prefix_of(deployment, role)
        self.grace_s = grace_s
        self.retry_s = retry_s
        self._secret = secret_bytes(secret)
        self._accept = accept
        self._on_change = on_change
        self._cond = threading.Condition()
        self._notify_lock = threading.Lock()
        self._members: dict[str, InstanceRecord] = {}
        self._missing_since: dict[str, float] = {}
        self._logged: dict[str, bytes] = {}  # key -> the ignored value last logged for it
        self._connected = False
        self._synced = False
        self._live = False  # a watch follows the last listing
        self._outage_logged = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"etcd-membership-{deployment}", daemon=True)
        self._ticker = threading.Thread(target=self._tick, name=f"etcd-membership-grace-{deployment}", daemon=True)
        self._thread.start()
        self._ticker.start()

    @property
    def connected(self) -> bool:
        """True while etcd answers (as of the last listing or watch)."""
        return self._connected

    def members(self, role: str | None = None) -> list[InstanceRecord]:
        with self._cond:
            found = [r for r in self._members.values() if role is None or r.role == role]
        return sorted(found, key=lambda r: (r.role, r.name))

    def wait_listed(self, timeout_s: float) -> bool:
        """Wait until the first listing is in (the members etcd held when this started); False
        if etcd did not answer within ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: self._synced, timeout_s)

    def wait_for(self, predicate: Callable[[list[InstanceRecord]], bool], timeout_s: float) -> bool:
        """Wait until ``predicate(members())`` holds; False if it still does not after ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.members()), timeout_s)

    def close(self, timeout_s: float = 3.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for thread in (self._thread, self._ticker):
            if thread is not threading.current_thread():
                thread.join(timeout_s)

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the loop

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                revision, kvs = self.client.get_prefix(self.prefix)
            except EtcdError as e:
                self._lost(e)
                self._stop.wait(self.retry_s)
                continue
            except Exception:
                log.exception("listing %s in etcd at %s failed", self.prefix, self.client.url)
                self._stop.wait(self.retry_s)
                continue
            self._change(functools.partial(self._apply_listing, kvs))
            watched_at = time.monotonic()
            try:
                for event in self.client.watch_prefix(self.prefix, revision + 1, self._stop):
                    self._change(functools.partial(self._apply_event, event))
            except EtcdError as e:
                log.debug("watch of %s in etcd at %s ended, listing again: %s", self.prefix, self.client.url, e)
            except Exception:
                log.exception("watch of %s in etcd at %s failed", self.prefix, self.client.url)
            self._live = False
            if time.monotonic() - watched_at < self.retry_s:
                self._stop.wait(self.retry_s)

    def _tick(self) -> None:
        while not self._stop.wait(min(0.25, self.grace_s / 4)):
            self._change(self._expire)

    def _lost(self, error: EtcdError) -> None:
        self._live = False
        with self._cond:
            self._connected = False
            self._missing_since.clear()  # grace starts again once etcd is back
            self._cond.notify_all()
            count = len(self._members)
        if not self._outage_logged:
            self._outage_logged = True
            what = "unreachable" if isinstance(error, EtcdUnavailable) else "failing"
            log.warning(
                "etcd %s; keeping the %d known member(s) of %s until it answers: %s", what, count, self.prefix, error
            )

    # changes: each computes (joined, left) under the state lock; _change reports them

    def _change(self, mutate: Callable[[], tuple[list[InstanceRecord], list[InstanceRecord]]]) -> None:
        with self._notify_lock:
            with self._cond:
                joined, left = mutate()
                self._cond.notify_all()  # a change, or a listing that found none (wait_listed)
            if (joined or left) and self._on_change is not None:
                try:
                    self._on_change(joined, left)
                except Exception:
                    log.exception("membership on_change callback failed")

    def _apply_listing(self, kvs: dict[str, bytes]) -> tuple[list[InstanceRecord], list[InstanceRecord]]:
        now = time.monotonic()
        joined: list[InstanceRecord] = []
        left: list[InstanceRecord] = []
        for key, raw in kvs.items():
            record = self._judge(key, raw)
            if record is not None:
                if self._members.get(key) != record:
                    self._members[key] = record
                    joined.append(record)
                self._missing_since.pop(key, None)
            elif key in self._members:  # its value is no longer one we take
                left.append(self._members.pop(key))
                self._missing_since.pop(key, None)
        for key in self._members:
            if key not in kvs:
                self._missing_since.setdefault(key, now)
        for key in [k for k in self._logged if k not in kvs]:
            del self._logged[key]
        if not self._connected and self._synced:
            log.info(
                "etcd at %s answers again: %d record(s) under %s, %d member(s) missing (they leave after %g s unless "
                "they come back)",
                self.client.url,
                len(kvs),
                self.prefix,
                len(self._missing_since),
                self.grace_s,
            )
        self._connected = True
        self._synced = True
        self._live = True
        self._outage_logged = False
        self._cond.notify_all()
        return joined, left

    def _apply_event(self, event: WatchEvent) -> tuple[list[InstanceRecord], list[InstanceRecord]]:
        self._connected = True
        if event.kind == "delete":
            self._logged.pop(event.key, None)
            self._missing_since.pop(event.key, None)
            gone = self._members.pop(event.key, None)
            return [], [gone] if gone is not None else []
        record = self._judge(event.key, event.value)
        self._missing_since.pop(event.key, None)
        if record is None:
            gone = self._members.pop(event.key, None)
            return [], [gone] if gone is not None else []
        if self._members.get(event.key) == record:
            return [], []
        self._members[event.key] = record
        return [record], []

    def _expire(self) -> tuple[list[InstanceRecord], list[InstanceRecord]]:
        if not (self._live and self._connected) or not self._missing_since:
            return [], []
        now = time.monotonic()
        left = []
        for key, since in list(self._missing_since.items()):
            if now - since >= self.grace_s:
                del self._missing_since[key]
                gone = self._members.pop(key, None)
                if gone is not None:
                    log.info("%s left: missing from etcd at %s for %g s", key, self.client.url, self.grace_s)
                    left.append(gone)
        return [], left

    def _judge(self, key: str, raw: bytes) -> InstanceRecord | None:
        """The record at ``key`` if it verifies and ``accept`` takes it; else None, logged once
        per key and value."""
        try:
            record = decode(raw, self._secret, key=key)
        except BadRecord as e:
            self._log_once(key, raw, f"ignoring the record at {key} in etcd at {self.client.url}: {e.reason}")
            return None
        reason: str | None = None
        if self._accept is not None:
            try:
                reason = self._accept(record)
            except Exception as e:
                reason = f"accept() raised {type(e).__name__}: {e}"
        if reason:
            self._log_once(key, raw, f"ignoring instance {record.name} ({record.role}, {key}): {reason}")
            return None
        self._logged.pop(key, None)
        return record

    def _log_once(self, key: str, raw: bytes, message: str) -> None:
        if self._logged.get(key) != raw:
            self._logged[key] = raw
            log.warning("%s", message)
