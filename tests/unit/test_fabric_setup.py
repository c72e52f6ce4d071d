"""Agent set-up over the fake NIXL: transport selection, NIXL loaded lazily (and absent),
pool validation, handshake over the TCP control channel (framing, refusal of incompatible
layouts). The real-NIXL counterparts are in tests/integration/test_fabric_real_nixl.py."""

import socket
import subprocess
import sys
from pathlib import Path

import fake_nixl
import pytest
import torch
from fabric_helpers import make_pools

from fabric_bridge import control, nixl_api
from fabric_bridge.agent import FabricAgent, TransportUnavailable
from fabric_bridge.layout import KVLayout, LayoutMismatch


def lay(**kw):
    base = dict(model="m", num_layers=2, page_size=4, num_kv_heads=8, head_dim=8, dtype="float32")
    base.update(kw)
    return KVLayout(**base)


def test_backend_failures_are_clear(fabric):
    pools = make_pools(lay(), 2)
    with pytest.raises(TransportUnavailable) as e:
        FabricAgent("lf", lay(), pools, backend="LIBFABRIC")  # the fake's LIBFABRIC finds no EFA
    assert "LIBFABRIC" in str(e.value) and "failed to start" in str(e.value)
    fabric.plugins = ["UCX"]
    with pytest.raises(TransportUnavailable, match="no such plugin.*UCX"):
        FabricAgent("lf2", lay(), pools, backend="LIBFABRIC")


def test_nixl_absent_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(nixl_api, "_real", None)  # an earlier integration test may have loaded it
    nixl_api.install(None)  # real NIXL, which this conftest blocks
    with pytest.raises(TransportUnavailable, match="NIXL is not installed"):
        FabricAgent("none", lay(), make_pools(lay(), 2))


def test_unit_tests_run_without_real_nixl():
    with pytest.raises(ImportError):
        import nixl_cu12  # noqa: F401
    assert nixl_api.load() is fake_nixl


def test_modules_import_without_nixl():
    code = (
        "import sys; sys.modules['nixl_cu12'] = sys.modules['nixl_cu13'] = None\n"
        "import fabric_bridge.agent, backend.disagg.nixl_connector\n"
        "assert not [m for m, mod in sys.modules.items() if m.startswith('nixl_cu') and mod is not None]\n"
    )
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr


def test_pool_validation():
    with pytest.raises(ValueError, match="shape"):
        FabricAgent("bad1", lay(), [[torch.zeros(3, 4, 2, 8, 8)] * 2])  # NHD-shaped pool for HND
    with pytest.raises(ValueError, match="dtype"):
        FabricAgent("bad2", lay(), [torch.zeros(2, 3, 2, 8, 4, 8, dtype=torch.float16)])
    with pytest.raises(ValueError, match="2 layers"):
        FabricAgent("bad3", lay(num_layers=3), make_pools(lay(), 2))


def test_framing_roundtrip_and_limits():
    a, b = socket.socketpair()
    with a, b:
        msg = {"md": control.b64(bytes(range(256))), "n": [1, 2]}
        control.send_msg(a, msg)
        got = control.recv_msg(b)
        assert got == msg and control.unb64(got["md"]) == bytes(range(256))
        a.sendall((control.MAX_FRAME + 1).to_bytes(4, "big"))
        with pytest.raises(ConnectionError, match="exceeds"):
            control.recv_msg(b)


def test_handshake_refuses_incompatible_pair_with_named_mismatch():
    """Per-layer tensor lists are accepted as pools too (here: shard list of layer lists)."""
    good, other = lay(tp_size=2), lay(head_dim=16)
    pools_a = [list(p.unbind(0)) for p in make_pools(good, 3)]
    a = FabricAgent("hs_a", good, pools_a)
    b = FabricAgent("hs_b", other, make_pools(other, 3))
    server = control.serve(a)
    try:
        with pytest.raises(control.HandshakeRefused) as e:
            control.connect(b, "127.0.0.1", server.port)
        assert "head_dim: 8 vs 16" in str(e.value)
        with pytest.raises(LayoutMismatch, match="head_dim"):
            b.add_peer(a.handshake_payload())
        assert a.pending() == 0
    finally:
        server.close()
        a.close()
        b.close()


def test_handshake_accepts_compatible_pair():
    x, y = lay(tp_size=1, layout="NHD"), lay(tp_size=4)
    a = FabricAgent("ok_a", x, make_pools(x, 3), meta_slots=2, meta_slot_floats=8)
    b = FabricAgent("ok_b", y, make_pools(y, 5), meta_slots=2, meta_slot_floats=8)
    server = control.serve(a)
    try:
        assert control.connect(b, "127.0.0.1", server.port) == "ok_a"
        payload = a.handshake_payload()
        assert payload["layout"]["layout"] == "NHD" and len(payload["shards"]) == 1
        assert payload["shards"][0]["num_pages"] == 3 and len(payload["shards"][0]["bases"]) == 2
    finally:
        server.close()
        a.close()
        b.close()
