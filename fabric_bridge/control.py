"""Control channel for the peer handshake: length-prefixed JSON over TCP (no pickle).

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON. Binary
fields (NIXL agent metadata) travel base64-encoded inside the JSON (:func:`b64`,
:func:`unb64`). The channel works across hosts; tests bind it to 127.0.0.1.

Handshake: the connecting side sends its payload (``FabricAgent.handshake_payload()``); the
listening side validates it (``add_peer``) and answers with its own payload, or with
``{"error": "..."}`` naming the mismatch; the connecting side then validates the answer.
After that both agents can write to each other and exchange notifications.

:func:`send_msg` / :func:`recv_msg` (the framing) and :func:`offer_handshake` /
:func:`answer_handshake` (the exchange) are public: the KV messenger
(``backend/disagg/messenger.py``) speaks the same framing and handshake, with its own payload.

Lock discipline: no lock here. A :class:`HandshakeServer` answers one handshake at a time on its
own thread; ``agent.add_peer``, which it calls there, takes the agent lock itself.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("triton_disagg.fabric")

MAX_FRAME = 64 << 20


class HandshakeRefused(RuntimeError):
    """The peer refused our handshake (e.g. incompatible KV layout)."""


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def send_msg(sock: socket.socket, obj: Any) -> None:
    data = json.dumps(obj).encode("utf-8")
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("control channel closed by peer")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket, max_bytes: int = MAX_FRAME) -> Any:
    """The next frame's JSON value; a frame longer than ``max_bytes`` is refused unread."""
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > max_bytes:
        raise ConnectionError(f"control frame of {n} bytes exceeds the {max_bytes} limit")
    return json.loads(_recv_exact(sock, n).decode("utf-8"))


def offer_handshake(sock: socket.socket, payload: dict) -> dict:
    """Connecting side: send our payload, return the peer's (:class:`HandshakeRefused` with the
    peer's reason if it refused)."""
    send_msg(sock, payload)
    reply = recv_msg(sock)
    if not isinstance(reply, dict):
        raise HandshakeRefused(f"peer answered the handshake with a {type(reply).__name__}")
    if "error" in reply:
        raise HandshakeRefused(f"peer refused the handshake: {reply['error']}")
    return reply


def answer_handshake(sock: socket.socket, on_peer: Callable[[dict], Any], payload: Callable[[], dict]) -> Any:
    """Listening side: read the peer's payload, validate it with ``on_peer`` (its result is
    returned), answer with ours; if ``on_peer`` raises, answer ``{"error": reason}`` and re-raise."""
    peer = recv_msg(sock)
    try:
        if not isinstance(peer, dict):
            raise ValueError(f"handshake payload must be a JSON object, got {type(peer).__name__}")
        result = on_peer(peer)
    except Exception as e:
        try:
            send_msg(sock, {"error": str(e)})
        except OSError:
            pass
        raise
    send_msg(sock, payload())
    return result


class HandshakeServer:
    """Answer handshakes on ``host:port`` (port 0 picks a free one) in a background thread.

    ``payload`` is a callable returning our handshake payload; ``on_peer`` validates and adds
    a peer's payload, raising to refuse it.
    """

    def __init__(
        self, payload: Callable[[], dict], on_peer: Callable[[dict], Any], host: str = "127.0.0.1", port: int = 0
    ):
        self._payload, self._on_peer = payload, on_peer
        self._sock = socket.create_server((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._serve, name="fabric-handshake", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(30)
                    answer_handshake(conn, self._on_peer, self._payload)
                except (OSError, ConnectionError) as e:
                    log.warning("handshake connection failed: %s", e)
                except Exception as e:  # refused: the peer got the reason
                    log.warning("refused a handshake: %s", e)

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)


def handshake(host: str, port: int, payload: dict, timeout_s: float = 30.0) -> dict:
    """Send our payload to a :class:`HandshakeServer` and return the peer's payload."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        try:
            return offer_handshake(sock, payload)
        except HandshakeRefused as e:
            raise HandshakeRefused(f"peer at {host}:{port}: {e}") from None


def connect(agent, host: str, port: int, timeout_s: float = 30.0) -> str:
    """Handshake ``agent`` with the agent served at ``host:port``; return the peer's name."""
    return agent.add_peer(handshake(host, port, agent.handshake_payload(), timeout_s))


def serve(agent, host: str = "127.0.0.1", port: int = 0) -> HandshakeServer:
    """Serve handshakes for ``agent``; see :class:`HandshakeServer`."""
    return HandshakeServer(agent.handshake_payload, agent.add_peer, host, port)
