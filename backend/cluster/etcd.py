"""A small etcd v3 client over etcd's JSON gateway (HTTP POST under ``/v3/``, keys and values
base64): leases, put / delete, a prefix listing and a streaming prefix watch. Everything the
cluster membership needs, nothing more.

Why the JSON gateway: etcd 3.4 serves it on its client port with no client library, while the
``etcd3`` PyPI package (0.12, 2020, gRPC) pins ``protobuf==3.6.1`` and its generated ``_pb2``
modules fail to import with the protobuf in ``.venv`` (6.33: "Descriptors cannot be created
directly"), and ``aetcd`` is asyncio-only.

Every call has a short timeout (``timeout_s``, 2 s by default); an etcd that cannot be reached
raises ``EtcdUnavailable`` naming its URL; an answer with an error raises ``EtcdError``.
``watch_prefix`` returns when its ``stop_event`` is set and raises ``WatchBroken`` (a
``ConnectionError``) when the stream breaks or etcd cancels it (compaction): callers re-list.

measured here: put 1.2 ms, range 1.0 ms median of 200 calls each (a 300-byte value; a range
of 5 keys), through one kept-alive HTTP connection to a local etcd 3.4.23 (AMD EPYC, 2 cores);
three runs gave put 1.19-1.43 ms, range 0.93-1.01 ms.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests


class EtcdError(Exception):
    """etcd answered with an error (or with something that is not its JSON)."""


class EtcdUnavailable(EtcdError, ConnectionError):
    """etcd could not be reached (refused, timed out, connection broken)."""


class WatchBroken(EtcdError, ConnectionError):
    """A watch stream ended: the connection broke, or etcd cancelled it (e.g. its start revision
    was compacted). The caller lists again and watches from the new revision."""


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" | "delete"
    key: str
    value: bytes  # b"" for a delete
    mod_revision: int


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_range_end(prefix: bytes) -> bytes:
    """etcd's range end for every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def base_url(url: str) -> str:
    """``etcd://HOST:PORT`` or ``http://HOST:PORT`` -> ``http://HOST:PORT``."""
    parts = urlsplit(url)
    if parts.scheme not in ("etcd", "http") or not parts.hostname or parts.port is None:
        raise ValueError(f"etcd URL {url!r}: expected etcd://HOST:PORT or http://HOST:PORT")
    if parts.path not in ("", "/") or parts.query:
        raise ValueError(f"etcd URL {url!r}: expected no path or query")
    return f"http://{parts.netloc}"


class EtcdClient:
    """The etcd at ``url`` (``etcd://HOST:PORT`` or ``http://HOST:PORT``); safe to share
    between threads (one HTTP session per thread)."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self.base = base_url(url)
        self.url = url
        self.timeout_s = timeout_s
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"EtcdClient({self.url!r})"

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.trust_env = False  # no proxy from the environment between us and etcd
            self._local.session = session
        return session

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = self._session().post(self.base + path, json=body, timeout=self.timeout_s)
        except requests.RequestException as e:
            self._local.session = None  # a fresh connection next time
            raise EtcdUnavailable(f"etcd at {self.url} is unreachable ({type(e).__name__}: {e})") from None
        try:
            answer = resp.json()
        except ValueError:
            raise EtcdError(f"etcd at {self.url}: {path} answered HTTP {resp.status_code}, not JSON") from None
        if not isinstance(answer, dict):
            raise EtcdError(f"etcd at {self.url}: {path} answered {answer!r}")
        if "error" in answer or resp.status_code != 200:
            raise EtcdError(f"etcd at {self.url}: {path}: {answer.get('error') or answer.get('message') or answer}")
        return answer

    # leases

    def grant(self, ttl_s: float) -> int:
        """A new lease of ``ttl_s`` seconds (rounded up to whole seconds, at least 1); its ID."""
        ttl = max(1, int(-(-ttl_s // 1)))
        return int(self._call("/v3/lease/grant", {"TTL": ttl})["ID"])

    def keepalive(self, lease_id: int) -> int:
        """Refresh the lease; its remaining TTL in seconds, 0 when the lease is gone."""
        answer = self._call("/v3/lease/keepalive", {"ID": str(lease_id)})
        result = answer.get("result", answer)
        return int(result.get("TTL", 0)) if isinstance(result, dict) else 0

    def revoke(self, lease_id: int) -> None:
        """Revoke the lease (its keys are deleted); a lease already gone is not an error."""
        try:
            self._call("/v3/lease/revoke", {"ID": str(lease_id)})
        except EtcdUnavailable:
            raise
        except EtcdError as e:
            if "lease not found" not in str(e):
                raise

    # keys

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        """Write ``key``; the revision of the write. With ``lease``, the key goes with the lease."""
        body: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self._call("/v3/kv/put", body).get("header", {}).get("revision", 0))

    def delete(self, key: str) -> int:
        """Delete ``key``; how many keys were deleted (0 or 1)."""
        return int(self._call("/v3/kv/deleterange", {"key": _b64(key.encode())}).get("deleted", 0))

    def get_prefix(self, prefix: str) -> tuple[int, dict[str, bytes]]:
        """Every key under ``prefix`` with its value, and the store's revision of that view."""
        raw = prefix.encode()
        answer = self._call("/v3/kv/range", {"key": _b64(raw), "range_end": _b64(prefix_range_end(raw))})
        revision = int(answer.get("header", {}).get("revision", 0))
        kvs = {_unb64(kv["key"]).decode(errors="replace"): _unb64(kv.get("value", "")) for kv in answer.get("kvs", [])}
        return revision, kvs

    def watch_prefix(self, prefix: str, start_revision: int, stop_event: threading.Event) -> Iterator[WatchEvent]:
        """The changes under ``prefix`` from ``start_revision`` on, as they happen. Returns once
        ``stop_event`` is set; raises ``EtcdUnavailable`` when the watch cannot be opened and
        ``WatchBroken`` when the stream ends or is cancelled."""
        raw = prefix.encode()
        create: dict[str, Any] = {
            "key": _b64(raw),
            "range_end": _b64(prefix_range_end(raw)),
            "start_revision": str(max(1, start_revision)),
            "progress_notify": True,
        }
        session = requests.Session()  # its own connection: closed under the reader to stop it
        session.trust_env = False
        try:
            resp = session.post(
                self.base + "/v3/watch", json={"create_request": create}, stream=True, timeout=(self.timeout_s, None)
            )
        except requests.RequestException as e:
            session.close()
            raise EtcdUnavailable(f"etcd at {self.url} is unreachable ({type(e).__name__}: {e})") from None
        done = threading.Event()
        closer = threading.Thread(
            target=_close_when_stopped, args=(resp, stop_event, done), name="etcd-watch-closer", daemon=True
        )
        closer.start()
        try:
            if resp.status_code != 200:
                raise WatchBroken(f"etcd at {self.url}: /v3/watch answered HTTP {resp.status_code}")
            for line in resp.iter_lines():
                if stop_event.is_set():
                    return
                if not line:
                    continue
                try:
                    message = json.loads(line)
                except ValueError:
                    raise WatchBroken(f"etcd at {self.url}: the watch sent {line[:200]!r}") from None
                if "error" in message:
                    raise WatchBroken(f"etcd at {self.url}: the watch failed: {message['error']}")
                result = message.get("result", {})
                if result.get("canceled"):
                    reason = result.get("cancel_reason") or (
                        f"revision {start_revision} compacted (now {result.get('compact_revision')})"
                    )
                    raise WatchBroken(f"etcd at {self.url} cancelled the watch: {reason}")
                for event in result.get("events", []):
                    kv = event.get("kv", {})
                    yield WatchEvent(
                        kind="delete" if event.get("type") == "DELETE" else "put",
                        key=_unb64(kv.get("key", "")).decode(errors="replace"),
                        value=_unb64(kv.get("value", "")),
                        mod_revision=int(kv.get("mod_revision", 0)),
                    )
        except (requests.RequestException, OSError, ValueError) as e:
            if stop_event.is_set():
                return
            if isinstance(e, WatchBroken):
                raise
            raise WatchBroken(f"etcd at {self.url}: the watch broke ({type(e).__name__}: {e})") from None
        finally:
            done.set()
            resp.close()
            session.close()
        if not stop_event.is_set():
            raise WatchBroken(f"etcd at {self.url} closed the watch stream")


def _close_when_stopped(resp: requests.Response, stop_event: threading.Event, done: threading.Event) -> None:
    """Unblock a reader of ``resp`` once ``stop_event`` is set: shut its socket down (closing it
    from another thread would not wake a blocked read)."""
    while not done.is_set():
        if stop_event.wait(0.1):
            conn = getattr(resp.raw, "connection", None) or getattr(resp.raw, "_connection", None)
            sock = getattr(conn, "sock", None)
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            return
