"""KV messenger connections: one TCP connection per (decode instance, prefill instance),
speaking the typed protocol of ``backend/disagg/protocol.py`` over ``fabric_bridge.control``'s
framing and handshake exchange.

Decode side: :class:`PrefillEndpoint` (one per configured prefill address, connects lazily,
tracks its outstanding requests). Prefill side: :class:`MessengerServer` (accepts decode
instances, answers their hello, dispatches their messages tagged with the connection they
came on). A message that breaks the protocol is logged and dropped; a dropped connection is
reported to the owner, who fails the requests that depended on it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from backend.disagg.protocol import PROTOCOL_VERSION, Hello, Message, ProtocolError, check_hello, decode, encode
from fabric_bridge.control import answer_handshake, offer_handshake, recv_msg, send_msg
from fabric_bridge.layout import KVLayout

log = logging.getLogger("triton_disagg.messenger")


class Connection:
    """A framed connection with a reader thread carrying protocol messages; ``send`` is thread-safe."""

    def __init__(
        self, sock: socket.socket, on_message: Callable[[Message], None], on_closed: Callable[[str], None], name: str
    ):
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

    def send(self, msg: Message) -> None:
        if self.closed:
            raise ConnectionError(f"connection {self.name} is closed")
        try:
            with self._send_lock:
                send_msg(self.sock, encode(msg))
        except OSError as e:
            self.close(f"send failed: {e}")
            raise ConnectionError(f"connection {self.name}: {e}") from e

    def _read_loop(self) -> None:
        reason = "closed by peer"
        try:
            while not self.closed:
                raw = recv_msg(self.sock)
                try:
                    msg = decode(raw)
                except ProtocolError as e:
                    log.warning("%s: dropped a message that breaks the protocol: %s", self.name, e)
                    continue
                try:
                    self._on_message(msg)
                except Exception:
                    log.exception("%s: handling %s failed", self.name, type(msg).__name__)
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


class PrefillEndpoint:
    """Decode side of one prefill instance: connects lazily, tracks outstanding requests."""

    RETRY_S = 1.0

    def __init__(
        self,
        host: str,
        port: int,
        agent,
        name: str,
        on_message: Callable[["PrefillEndpoint", Message], None],
        on_lost: Callable[["PrefillEndpoint", str], None],
        connect_timeout_s: float = 5.0,
    ):
        self.host, self.port = host, port
        self.address = f"{host}:{port}"
        self.agent, self.name = agent, name
        self.peer: str | None = None
        self.layout: KVLayout | None = None
        self.outstanding: set[str] = set()
        self._on_message, self._on_lost = on_message, on_lost
        self._connect_timeout_s = connect_timeout_s
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._last_attempt = 0.0
        self.last_error: str | None = None

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
                reply = offer_handshake(
                    sock, encode(Hello(PROTOCOL_VERSION, self.name, self.agent.handshake_payload()))
                )
                hello = check_hello(decode(reply))
                self.peer = self.agent.add_peer(hello.fabric)
                self.layout = KVLayout.from_dict(hello.fabric["layout"])
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                if error != self.last_error:  # log changes, not every retry
                    log.warning("prefill endpoint %s unavailable: %s", self.address, error)
                self.last_error = error
                return False
            self._conn = Connection(
                sock, lambda m: self._on_message(self, m), self._closed, f"prefill@{self.address}"
            ).start()
            log.info("connected to prefill instance %s (agent %s)", self.address, self.peer)
            return True

    def send(self, msg: Message) -> None:
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

    ``on_message(peer, msg, conn)`` handles requests and cancels (``conn``: the connection the
    message came on, which owns the requests it created); ``on_peer_lost(peer, reason)`` runs
    when a decode instance's connection drops.
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
            peer = answer_handshake(
                sock,
                self._accept_hello,
                lambda: encode(Hello(PROTOCOL_VERSION, self.name, self.agent.handshake_payload())),
            )
        except Exception as e:
            log.warning("refused decode instance at %s: %s", addr, e)
            sock.close()
            return
        holder = {}
        conn = Connection(
            sock,
            lambda m: self._on_message(peer, m, holder["conn"]),
            lambda reason: self._on_peer_lost(peer, reason),
            f"decode@{addr[0]}:{addr[1]}",
        )
        holder["conn"] = conn
        self._conns.append(conn)
        conn.start()
        log.info("decode instance %s connected from %s:%d", peer, addr[0], addr[1])

    def _accept_hello(self, payload: dict) -> str:
        hello = check_hello(decode(payload))
        peer = self.agent.add_peer(hello.fabric)
        self.peer_layouts[peer] = KVLayout.from_dict(hello.fabric["layout"])
        return peer

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept(); close() alone leaves it listening
        except OSError:
            pass
        self._sock.close()
        for c in self._conns:
            c.close("shutdown")
