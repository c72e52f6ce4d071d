"""Attack clients against a real prefill instance's KV messenger (on a real tritonserver): no
NIXL metadata and no work without the deployment secret, limits on slow or huge handshakes and
on connections, and an authenticated peer's bad requests fail alone.

Shares the session's ``disagg_server`` and must run before ``test_disagg_server.py``, whose
last test kills a prefill instance (pytest runs the files in name order)."""

from __future__ import annotations

import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from backend.client import stream_generate
from backend.disagg import auth
from backend.disagg.protocol import PROTOCOL_VERSION, AuthChallenge, Hello, PrefillFailed, PrefillRequest, encode
from backend.engine.outputs import ErrorKind
from build_scripts.render_repository import read_parameters
from fabric_bridge.control import recv_msg, send_msg
from tests.conftest import PROMPTS, wait_pool_free

pytestmark = pytest.mark.usefixtures("nixl")


def endpoint(server) -> tuple[str, int]:
    """Where the deployment's first prefill model's messenger listens (its rendered config)."""
    cfg = read_parameters((Path(server.repo) / "prefill_0" / "config.pbtxt").read_text())
    return cfg["messenger_host"], int(cfg["messenger_port"])


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True if the peer closes the connection within ``seconds`` (reads and drops what comes)."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except OSError:
        return True
    return False


def test_wrong_secret_gets_no_nixl_metadata(disagg_server):
    with socket.create_connection(endpoint(disagg_server), timeout=10) as s:
        send_msg(s, encode(AuthChallenge(PROTOCOL_VERSION, "intruder", auth.new_nonce())))
        response = recv_msg(s)
        assert response["type"] == "auth_response" and set(response) == {"type", "nonce", "proof"}
        send_msg(s, encode(Hello(PROTOCOL_VERSION, "intruder", {"name": "intruder"}, "0" * 64)))
        reply = recv_msg(s)
        assert set(reply) == {"error"} and "did not prove the deployment secret" in reply["error"], reply
        assert closed_within(s, 5)


def test_unauthenticated_hello_is_refused(disagg_server):
    with socket.create_connection(endpoint(disagg_server), timeout=10) as s:
        send_msg(s, {"type": "hello", "version": 1, "name": "old", "fabric": {}, "proof": ""})
        reply = recv_msg(s)
        assert set(reply) == {"error"} and "expected auth_challenge" in reply["error"], reply
        assert closed_within(s, 5)


def test_slow_and_huge_handshakes_are_cut(disagg_server):
    with socket.create_connection(endpoint(disagg_server), timeout=10) as huge:
        huge.sendall(struct.pack(">I", 100 << 20))  # a 100 MiB frame is refused unread
        assert closed_within(huge, 5)
    with socket.create_connection(endpoint(disagg_server), timeout=10) as slow:
        t0 = time.monotonic()
        closed = False
        for byte in struct.pack(">I", 64) + b"{" * 60:  # one byte a second never completes
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            if closed_within(slow, 1.0):
                closed = True
                break
        assert closed and time.monotonic() - t0 < 10 + 5  # messenger_handshake_timeout_s (10) + slack


def test_connection_cap(disagg_server):
    idle = [socket.create_connection(endpoint(disagg_server), timeout=10) for _ in range(64)]
    try:
        time.sleep(0.5)
        with socket.create_connection(endpoint(disagg_server), timeout=10) as extra:
            assert closed_within(extra, 5), "the 65th connection was accepted"
    finally:
        for s in idle:
            s.close()
    time.sleep(0.5)
    ok = stream_generate(disagg_server.grpc_url, PROMPTS[0], 4, model="decode_0", ignore_eos=True)
    assert ok.error is None and len(ok.token_ids) == 4, ok.error


def test_authenticated_peer_bad_requests_fail_alone(disagg_server, model_dir):
    """Even with the secret, a request that names pages outside the peer's pool or tokens outside
    the vocabulary is refused on its own; a legitimate request running meanwhile is unaffected;
    a second connection cannot take over a connected peer's name."""
    from fabric_helpers import make_pools

    from backend.disagg.messenger import PrefillEndpoint
    from fabric_bridge.agent import FabricAgent
    from fabric_bridge.layout import KVLayout

    layout = KVLayout(
        "SmolLM2-135M-Instruct+float32", 30, 16, 3, 64, "float32"
    )  # the model name carries the weights format
    agent = FabricAgent("attacker", layout, make_pools(layout, 4), meta_slots=1, meta_slot_floats=576 + 49152)
    got, lost = [], []
    secret = disagg_server.deployment_secret.encode()
    host, port = endpoint(disagg_server)
    ep = PrefillEndpoint(host, port, agent, "attacker", secret, lambda e, m: got.append(m), lambda e, r: lost.append(r))
    again = PrefillEndpoint(host, port, agent, "attacker", secret, lambda e, m: None, lambda e, r: None)
    box = {}
    legit = threading.Thread(
        target=lambda: box.update(
            r=stream_generate(disagg_server.grpc_url, PROMPTS[1], 8, model="decode_0", ignore_eos=True)
        )
    )
    try:
        assert ep.ensure_connected(force=True), ep.last_error
        legit.start()
        ep.send(PrefillRequest("evil-pages", 0, None, list(range(20)), [3, 10**6], 0))
        ep.send(PrefillRequest("evil-tokens", 0, None, [1, 2, 10**7], [0], 0))
        deadline = time.monotonic() + 20
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        failed = {m.req_id: m for m in got if isinstance(m, PrefillFailed)}
        assert set(failed) == {"evil-pages", "evil-tokens"}, got
        assert all(m.kind is ErrorKind.BAD_REQUEST for m in failed.values())
        assert "outside the receiver's pool" in failed["evil-pages"].message
        assert "outside the vocabulary" in failed["evil-tokens"].message
        deadline = time.monotonic() + 10  # the prefill instance's log says "refused", never "sent"
        while "refused prefill evil-tokens" not in disagg_server.log_file.read_text(errors="replace"):
            assert time.monotonic() < deadline, "the refusal is not in the server log"
            time.sleep(0.2)
        log_text = disagg_server.log_file.read_text(errors="replace")
        assert "refused prefill evil-pages" in log_text and "prefill evil-pages sent" not in log_text
        assert not again.ensure_connected(force=True) and "already connected" in again.last_error, again.last_error
        legit.join(120)
        assert box["r"].error is None and len(box["r"].token_ids) == 8, box["r"].error
    finally:
        ep.close()
        agent.close()
    for model in ("prefill_0", "prefill_1", "decode_0"):
        wait_pool_free(disagg_server.metrics_url, model)


def test_fabric_listens_on_loopback_only(disagg_server):
    """Every address its server listens on is loopback, so the NIXL/UCX listeners of the
    prefill and decode instances are bound to ``lo`` too (``fabric_device`` auto)."""
    import psutil

    pids = disagg_server.instance_pids()
    assert any(name.startswith("prefill_") for name in pids), pids
    listening = {
        name: [c.laddr.ip for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
        for name, pid in pids.items()
    }
    assert any(listening.values()), listening  # the messengers and UCX listen somewhere
    exposed = {name: ips for name, ips in listening.items() if any(ip not in ("127.0.0.1", "::1") for ip in ips)}
    assert not exposed, f"listeners outside loopback: {exposed}"
