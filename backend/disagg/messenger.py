"""KV messenger: the control protocol between decode instances and prefill instances.

One TCP connection per (decode instance, prefill instance), length-prefixed JSON frames
(``fabric_bridge.control`` framing). The KV bytes never travel here; they go over NIXL.

  decode -> prefill  {"type": "hello", "fabric": <agent handshake payload>}
  prefill -> decode  {"type": "hello", "fabric": <agent handshake payload>, "name": ...}
  decode -> prefill  {"type": "prefill", "req_id", "generation", "slot", "tokens", "dst_pages"}
  decode -> prefill  {"type": "cancel", "req_id"}
  prefill -> decode  {"type": "error", "req_id", "message"}      (the prefill will not run)

Decode side: :class:`PrefillEndpoint` (one per configured prefill address). Prefill side:
:class:`MessengerServer`. A dropped connection is reported to the owner, who fails the
requests that depended on it.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable, Optional

from fabric_bridge.control import recv_msg, send_msg
from fabric_bridge.layout import KVLayout

log = logging.getLogger("triton_disagg.messenger")


class Connection:
    """A framed JSON connection with a reader thread; ``send`` is thread-safe."""

    def __init__(self, sock: socket.socket, on_message: Callable[[dict], None],
                 on_closed: Callable[[str], None], name: str):
        self.sock = sock
        self.name = name
        self._on_message, self._on_closed = on_message, on_closed
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._thread = threading.Thread(target=self._read_loop, name=f"messenger-{name}", daemon=True)

    def start(self) -> "Connection":
        self._thread.start()
        return self

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, msg: dict) -> None:
        if self.closed:
            raise ConnectionError(f"connection {self.name} is closed")
        try:
            with self._send_lock:
                send_msg(self.sock, msg)
        except OSError as e:
            self.close(f"send failed: {e}")
            raise ConnectionError(f"connection {self.name}: {e}") from e

    def _read_loop(self) -> None:
        reason = "closed by peer"
        try:
            while not self.closed:
                msg = recv_msg(self.sock)
                try:
                    self._on_message(msg)
                except Exception:
                    log.exception("%s: handling %s failed", self.name, msg.get("type"))
        except (OSError, ConnectionError, ValueError) as e:
            reason = str(e) or type(e).__name__
        self.close(reason)

    def close(self, reason: str = "closed") -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self._on_closed(reason)
        except Exception:
            log.exception("%s: on_closed failed", self.name)


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """``"host:port,host:port"`` -> [(host, port), ...] with a clear error."""
    out = []
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"prefill endpoint {item!r} must be host:port")
        out.append((host, int(port)))
    if not out:
        raise ValueError("no prefill endpoints configured (parameter 'prefill_endpoints')")
    return out


class PrefillEndpoint:
    """Decode side of one prefill instance: connects lazily, tracks outstanding requests."""

    RETRY_S = 1.0

    def __init__(self, host: str, port: int, agent, on_message: Callable[["PrefillEndpoint", dict], None],
                 on_lost: Callable[["PrefillEndpoint", str], None], connect_timeout_s: float = 5.0):
        self.host, self.port = host, port
        self.address = f"{host}:{port}"
        self.agent = agent
        self.peer: Optional[str] = None
        self.layout: Optional[KVLayout] = None
        self.outstanding: set[str] = set()
        self._on_message, self._on_lost = on_message, on_lost
        self._connect_timeout_s = connect_timeout_s
        self._conn: Optional[Connection] = None
        self._lock = threading.Lock()
        self._last_attempt = 0.0
        self.last_error: Optional[str] = None

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def ensure_connected(self, force: bool = False) -> bool:
        """Connect and handshake if not connected (rate-limited unless ``force``)."""
        with self._lock:
            if self.connected:
                return True
            now = time.monotonic()
            if not force and now - self._last_attempt < self.RETRY_S:
                return False
            self._last_attempt = now
            try:
                sock = socket.create_connection((self.host, self.port), timeout=self._connect_timeout_s)
                sock.settimeout(self._connect_timeout_s)
                send_msg(sock, {"type": "hello", "fabric": self.agent.handshake_payload()})
                reply = recv_msg(sock)
                if reply.get("type") != "hello":
                    raise ConnectionError(reply.get("message", f"unexpected reply {reply.get('type')}"))
                self.peer = self.agent.add_peer(reply["fabric"])
                self.layout = KVLayout.from_dict(reply["fabric"]["layout"])
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                if error != self.last_error:   # log changes, not every retry
                    log.warning("prefill endpoint %s unavailable: %s", self.address, error)
                self.last_error = error
                return False
            self._conn = Connection(sock, lambda m: self._on_message(self, m), self._closed,
                                    f"prefill@{self.address}").start()
            log.info("connected to prefill instance %s (agent %s)", self.address, self.peer)
            return True

    def send(self, msg: dict) -> None:
        conn = self._conn
        if conn is None:
            raise ConnectionError(f"prefill endpoint {self.address} is not connected")
        conn.send(msg)

    def _closed(self, reason: str) -> None:
        self.last_error = reason
        log.warning("lost prefill instance %s: %s", self.address, reason)
        self._on_lost(self, reason)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close("shutdown")


class MessengerServer:
    """Prefill side: accepts decode instances, answers their handshake, dispatches messages.

    ``on_message(peer, msg, conn)`` handles prefill/cancel; ``on_peer_lost(peer)`` runs when a
    decode instance's connection drops.
    """

    def __init__(self, agent, host: str, port: int, on_message, on_peer_lost, name: str):
        self.agent, self.name = agent, name
        self._on_message, self._on_peer_lost = on_message, on_peer_lost
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = self._sock.getsockname()[:2]
        self._conns: list[Connection] = []
        self.peer_layouts: dict[str, KVLayout] = {}
        self._thread = threading.Thread(target=self._accept_loop, name="messenger-accept", daemon=True)
        self._thread.start()
        log.info("prefill instance %s: messenger listening on %s:%d", name, self.host, self.port)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(sock, addr), daemon=True).start()

    def _handshake(self, sock: socket.socket, addr) -> None:
        try:
            sock.settimeout(30)
            hello = recv_msg(sock)
            if hello.get("type") != "hello":
                raise ConnectionError(f"expected hello, got {hello.get('type')}")
            peer = self.agent.add_peer(hello["fabric"])
            self.peer_layouts[peer] = KVLayout.from_dict(hello["fabric"]["layout"])
            send_msg(sock, {"type": "hello", "fabric": self.agent.handshake_payload(), "name": self.name})
        except Exception as e:
            log.warning("refused decode instance at %s: %s", addr, e)
            try:
                send_msg(sock, {"type": "refused", "message": str(e)})
            except OSError:
                pass
            sock.close()
            return
        holder = {}
        conn = Connection(sock, lambda m: self._on_message(peer, m, holder["conn"]),
                          lambda reason: self._on_peer_lost(peer, reason), f"decode@{addr[0]}:{addr[1]}")
        holder["conn"] = conn
        self._conns.append(conn)
        conn.start()
        log.info("decode instance %s connected from %s:%d", peer, addr[0], addr[1])

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)   # wakes accept(); close() alone leaves it listening
        except OSError:
            pass
        self._sock.close()
        for c in self._conns:
            c.close("shutdown")
