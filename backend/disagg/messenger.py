"""KV messenger connections: one TCP connection per (decode instance, prefill instance),
speaking the typed protocol of ``backend/disagg/protocol.py`` over ``fabric_bridge.control``'s
framing and handshake exchange.

Decode side: :class:`PrefillEndpoint` (one per configured prefill address; its own connector
thread connects and handshakes, and reconnects after a loss, so no network I/O ever runs on the
worker's thread; the owner hears ``on_connected`` / ``on_lost`` / ``on_message`` as events).
Prefill side: :class:`MessengerServer` (accepts decode
instances, answers their hello, dispatches their messages tagged with the connection they
came on). A message that breaks the protocol is logged and dropped; a dropped connection is
reported to the owner, who fails the requests that depended on it.
"""

from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable

from backend.disagg import auth
from backend.disagg.connector import PeerAgent
from backend.disagg.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    AuthChallenge,
    AuthResponse,
    Hello,
    Message,
    ProtocolError,
    decode,
    encode,
    require,
)
from fabric_bridge.control import answer_handshake, offer_handshake, recv_msg, send_msg
from fabric_bridge.layout import KVLayout

log = logging.getLogger("triton_disagg.messenger")


class Connection:
    """A framed connection with a reader thread carrying protocol messages and a writer thread
    sending them: ``send`` only queues (thread-safe, never blocks on the network), so a worker
    loop that sends is never held up by a peer that stops reading. A peer that lets
    ``MAX_QUEUED_FRAMES`` pile up, or whose socket takes no bytes for ``SEND_TIMEOUT_S``, loses the
    connection (its owner hears it as a lost peer)."""

    MAX_QUEUED_FRAMES = 4096
    SEND_TIMEOUT_S = 30

    def __init__(
        self, sock: socket.socket, on_message: Callable[[Message], None], on_closed: Callable[[str], None], name: str
    ):
        self.sock = sock
        self.name = name
        self._on_message, self._on_closed = on_message, on_closed
        self._closed = threading.Event()
        self._outbox: queue.Queue[dict | None] = queue.Queue(self.MAX_QUEUED_FRAMES)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # a blocking send that makes no progress this long fails (the reader keeps no timeout)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", self.SEND_TIMEOUT_S, 0))
        self._thread = threading.Thread(target=self._read_loop, name=f"messenger-{name}", daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name=f"messenger-send-{name}", daemon=True)

    def start(self) -> "Connection":
        self._thread.start()
        self._writer.start()
        return self

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, msg: Message) -> None:
        """Queue ``msg`` (encoded and checked here); ConnectionError if the connection is closed
        or the peer has stopped reading."""
        if self.closed:
            raise ConnectionError(f"connection {self.name} is closed")
        frame = encode(msg)
        try:
            self._outbox.put_nowait(frame)
        except queue.Full:
            self.close(f"the peer reads nothing: {self.MAX_QUEUED_FRAMES} messages queued")
            raise ConnectionError(f"connection {self.name}: the peer reads nothing") from None

    def _write_loop(self) -> None:
        while True:
            frame = self._outbox.get()
            if frame is None or self.closed:
                self._outbox.task_done()
                return
            try:
                send_msg(self.sock, frame)
            except OSError as e:
                self.close(f"send failed: {e}")
                return
            finally:
                self._outbox.task_done()

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until every queued message is handed to the socket."""
        deadline = time.monotonic() + timeout_s
        while self._outbox.unfinished_tasks and not self.closed and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._outbox.unfinished_tasks

    def _read_loop(self) -> None:
        reason = "closed by peer"
        try:
            while not self.closed:
                msg = decode(recv_msg(self.sock, MAX_FRAME_BYTES))
                try:
                    self._on_message(msg)
                except Exception:
                    log.exception("%s: handling %s failed", self.name, type(msg).__name__)
        except ProtocolError as e:  # a peer that breaks the protocol is not talked to any more
            reason = f"protocol error: {e}"
            log.warning("%s: closing the connection: %s", self.name, reason)
        except (OSError, ConnectionError, ValueError) as e:
            reason = str(e) or type(e).__name__
        self.close(reason)

    def close(self, reason: str = "closed") -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._outbox.put_nowait(None)  # wakes the writer
        except queue.Full:
            pass  # the writer sees the connection closed at its next frame or failed send
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
    """Decode side of one prefill instance. :meth:`start` runs the connector thread (connect,
    authenticate, handshake; again ``RETRY_S`` after a failure or a loss; at once after
    :meth:`wake`). ``outstanding`` (the requests waiting for its KV) belongs to the owner's thread."""

    RETRY_S = 1.0

    def __init__(
        self,
        host: str,
        port: int,
        agent: PeerAgent,
        name: str,
        secret: bytes,
        on_message: Callable[["PrefillEndpoint", Message], None],
        on_lost: Callable[["PrefillEndpoint", str], None],
        connect_timeout_s: float = 5.0,
        on_connected: Callable[["PrefillEndpoint"], None] | None = None,
    ):
        self.host, self.port = host, port
        self.address = f"{host}:{port}"
        self.agent, self.name, self._secret = agent, name, secret
        self.peer: str | None = None
        self.layout: KVLayout | None = None
        self.outstanding: set[str] = set()
        self._on_message, self._on_lost = on_message, on_lost
        self._connect_timeout_s = connect_timeout_s
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._last_attempt = 0.0
        self.last_error: str | None = None
        self._on_connected = on_connected
        self.generation = 0  # counts this endpoint's connections; the current one's number
        self.lost_generation = 0  # the number of the connection last lost (read in on_lost)
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PrefillEndpoint:
        """Keep this endpoint connected from a thread of its own."""
        self._thread = threading.Thread(target=self._connect_loop, name=f"connect-{self.address}", daemon=True)
        self._thread.start()
        return self

    def wake(self) -> None:
        """Try to connect now (a request is waiting for a prefill instance)."""
        self._wake.set()

    def _connect_loop(self) -> None:
        while not self._closing.is_set():
            if not self.connected and self.ensure_connected(force=True) and self._on_connected is not None:
                try:
                    self._on_connected(self)
                except Exception:
                    log.exception("prefill endpoint %s: on_connected failed", self.address)
            self._wake.wait(self.RETRY_S)
            self._wake.clear()

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
                hello = self._authenticated_hello(sock)
                self.peer = self.agent.add_peer(hello.fabric)
                self.layout = KVLayout.from_dict(hello.fabric["layout"])
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                if error != self.last_error:  # log changes, not every retry
                    log.warning("prefill endpoint %s unavailable: %s", self.address, error)
                self.last_error = error
                return False
            self.generation += 1
            gen = self.generation
            self._conn = Connection(
                sock, lambda m: self._on_message(self, m), lambda r: self._closed(r, gen), f"prefill@{self.address}"
            ).start()
            log.info("connected to prefill instance %s (agent %s)", self.address, self.peer)
            return True

    def _authenticated_hello(self, sock: socket.socket) -> Hello:
        """Prove the secret both ways (see ``backend/disagg/auth.py``), then exchange hellos."""
        mine = auth.new_nonce()
        send_msg(sock, encode(AuthChallenge(PROTOCOL_VERSION, self.name, mine)))
        response = require(decode(recv_msg(sock, MAX_FRAME_BYTES)), AuthResponse)
        auth.verify(self._secret, "prefill", mine, response.nonce, response.proof)
        hello = Hello(
            PROTOCOL_VERSION,
            self.name,
            self.agent.handshake_payload(),
            auth.proof(self._secret, "decode", response.nonce, mine),
        )
        return require(decode(offer_handshake(sock, encode(hello))), Hello)

    def send(self, msg: Message) -> None:
        conn = self._conn
        if conn is None:
            raise ConnectionError(f"prefill endpoint {self.address} is not connected")
        conn.send(msg)

    def _closed(self, reason: str, generation: int) -> None:
        self.last_error = reason
        self.lost_generation = generation
        log.warning("lost prefill instance %s: %s", self.address, reason)
        self._on_lost(self, reason)

    def close(self) -> None:
        self._closing.set()
        self._wake.set()
        if self._conn is not None:
            self._conn.close("shutdown")
        if self._thread is not None:
            self._thread.join(timeout=self._connect_timeout_s + 1)


class MessengerServer:
    """Prefill side: accepts decode instances, answers their handshake, dispatches messages.

    ``on_message(peer, msg, conn)`` handles requests and cancels (``conn``: the connection the
    message came on, which owns the requests it created); ``on_peer_lost(peer, reason)`` runs
    when a decode instance's connection drops. A peer must prove the deployment secret before
    it sees this instance's NIXL metadata; the whole handshake has ``handshake_timeout_s``; at
    most ``max_connections`` decode instances are connected (handshakes included); a name that
    is already connected cannot be taken over.
    """

    def __init__(
        self,
        agent: PeerAgent,
        host: str,
        port: int,
        on_message,
        on_peer_lost,
        name: str,
        secret: bytes,
        max_connections: int = 64,
        handshake_timeout_s: float = 10.0,
    ):
        self.agent, self.name, self._secret = agent, name, secret
        self._on_message, self._on_peer_lost = on_message, on_peer_lost
        self.max_connections, self.handshake_timeout_s = max_connections, handshake_timeout_s
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = self._sock.getsockname()[:2]
        self._conns: dict[str, Connection] = {}  # peer name -> its live connection
        self._handshaking = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="messenger-accept", daemon=True)
        self._thread.start()
        log.info("prefill instance %s: messenger listening on %s:%d", name, self.host, self.port)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            with self._lock:
                live = sum(not c.closed for c in self._conns.values()) + self._handshaking
                full = live >= self.max_connections
                if not full:
                    self._handshaking += 1
            if full:
                log.warning(
                    "refused a connection from %s:%d: %d connections already (messenger_max_connections)",
                    addr[0],
                    addr[1],
                    live,
                )
                sock.close()
                continue
            threading.Thread(target=self._handshake, args=(sock, addr), daemon=True).start()

    def _handshake(self, sock: socket.socket, addr) -> None:
        deadline = threading.Timer(self.handshake_timeout_s, _shutdown, args=(sock,))
        deadline.start()  # the whole handshake, however slowly the peer trickles its bytes
        try:
            sock.settimeout(self.handshake_timeout_s)
            try:
                challenge = require(decode(recv_msg(sock, MAX_FRAME_BYTES)), AuthChallenge)
            except (ProtocolError, ValueError) as e:  # answer why before closing
                send_msg(sock, {"error": str(e)})
                raise
            mine = auth.new_nonce()
            send_msg(sock, encode(AuthResponse(mine, auth.proof(self._secret, "prefill", challenge.nonce, mine))))
            peer = answer_handshake(
                sock,
                lambda payload: self._accept_hello(payload, challenge.nonce, mine),
                lambda: encode(Hello(PROTOCOL_VERSION, self.name, self.agent.handshake_payload(), "")),
            )
        except Exception as e:
            log.warning("refused decode instance at %s:%d: %s", addr[0], addr[1], e)
            sock.close()
            return
        finally:
            deadline.cancel()
            with self._lock:
                self._handshaking -= 1
        holder: dict[str, Connection] = {}
        conn = Connection(
            sock,
            lambda m: self._on_message(peer, m, holder["conn"]),
            lambda reason: self._on_peer_lost(peer, reason),
            f"decode@{addr[0]}:{addr[1]}",
        )
        holder["conn"] = conn
        with self._lock:
            self._conns[peer] = conn
        conn.start()
        log.info("decode instance %s connected from %s:%d", peer, addr[0], addr[1])

    def _accept_hello(self, payload: dict, theirs: str, mine: str) -> str:
        """The peer's hello: its proof first, then (only then) its NIXL metadata."""
        hello = require(decode(payload), Hello)
        auth.verify(self._secret, "decode", mine, theirs, hello.proof)
        name = hello.fabric.get("name")
        with self._lock:
            existing = self._conns.get(name)
            if existing is not None and not existing.closed:
                raise auth.AuthError(f"a decode instance named {name!r} is already connected")
        return self.agent.add_peer(hello.fabric)

    def broadcast(self, msg: Message) -> int:
        """Send ``msg`` to every connected decode instance; returns how many it reached."""
        with self._lock:
            conns = [c for c in self._conns.values() if not c.closed]
        sent = 0
        for c in conns:
            try:
                c.send(msg)
                sent += 1
            except ConnectionError:
                pass  # its reader reports the loss
        return sent

    def connections(self) -> int:
        with self._lock:
            return sum(not c.closed for c in self._conns.values())

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept(); close() alone leaves it listening
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            c.flush(1.0)  # what was said last (a failure's reason) goes out before the connection ends
            c.close("shutdown")


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv()
    except OSError:
        pass
