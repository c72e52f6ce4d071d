"""Agent set-up: transport selection, pool validation, handshake over the TCP control
channel (framing, refusal of incompatible layouts)."""

import socket

import pytest
import torch
from fabric_helpers import make_pools

from fabric_bridge import control
from fabric_bridge.agent import FabricAgent, TransportUnavailable
from fabric_bridge.layout import KVLayout, LayoutMismatch


def lay(**kw):
    base = dict(model="m", num_layers=2, page_size=4, num_kv_heads=8, head_dim=8, dtype="float32")
    base.update(kw)
    return KVLayout(**base)


def test_libfabric_unavailable_is_a_clear_error():
    with pytest.raises(TransportUnavailable) as e:
        FabricAgent("lf", lay(), make_pools(lay(), 2), backend="LIBFABRIC")
    msg = str(e.value)
    assert "LIBFABRIC" in msg and "failed to start" in msg
    print("LIBFABRIC error as reported:", msg)


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
