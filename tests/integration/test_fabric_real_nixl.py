"""Agent set-up over real NIXL (moved from tests/unit, which run on tests/fake_nixl.py):
NIXL is loaded at the first agent, LIBFABRIC without EFA fails with a clear error, and two
agents of this process handshake over TCP and move bytes over UCX."""

import random
import time

import pytest
import torch
from fabric_helpers import make_pools

from fabric_bridge import control, nixl_api
from fabric_bridge.agent import FabricAgent, TransportUnavailable
from fabric_bridge.layout import KVLayout
from fabric_bridge.plan import build_plan, expected_writes

pytestmark = pytest.mark.usefixtures("nixl")


def lay(**kw):
    base = dict(model="m", num_layers=2, page_size=4, num_kv_heads=8, head_dim=8, dtype="float32")
    base.update(kw)
    return KVLayout(**base)


def test_real_nixl_is_what_agents_use():
    assert nixl_api.load().__name__ in ("nixl_cu12._api", "nixl_cu13._api")


def test_libfabric_unavailable_is_a_clear_error():
    with pytest.raises(TransportUnavailable) as e:
        FabricAgent("lf", lay(), make_pools(lay(), 2), backend="LIBFABRIC")
    msg = str(e.value)
    assert "LIBFABRIC" in msg and ("failed to start" in msg or "no such plugin" in msg)
    print("LIBFABRIC error as reported:", msg)


def test_handshake_and_transfer_in_one_process():
    src, dst = lay(tp_size=1, layout="NHD"), lay(tp_size=4)
    s_pools, r_pools = make_pools(src, 3, seed=5), make_pools(dst, 5)
    s = FabricAgent("real_s", src, s_pools, meta_slots=2, meta_slot_floats=8)
    r = FabricAgent("real_r", dst, r_pools, meta_slots=2, meta_slot_floats=8)
    server = control.serve(r)
    try:
        assert control.connect(s, "127.0.0.1", server.port) == "real_r"
        h = r.expect("q", expected_writes(src, dst, 2), timeout_s=20, peer="real_s")
        plan = build_plan(src, dst, [2, 0], [4, 1], random.Random(0))
        assert all(s.post_layer("real_r", "q", h.generation, plan, layer) for layer in range(2))
        assert s.post_meta("real_r", "q", h.generation, h.slot, torch.ones(3), torch.zeros(2))
        sent = []
        s.finish_send("q", lambda *a: sent.append(a))
        assert h.wait(20), h.error
        assert h.meta.tolist() == [1, 1, 1, 0, 0]
        for layer in range(2):
            for sp, dp in ((2, 4), (0, 1)):
                want = s_pools[0][layer, sp].permute(1, 2, 0, 3)  # NHD page -> HND [2, heads, tok, dim]
                got = torch.cat([r_pools[d][layer, dp] for d in range(4)], dim=1)
                assert torch.equal(got, want)
        end = time.monotonic() + 10
        while (s.pending() or not sent) and time.monotonic() < end:
            time.sleep(0.01)
        assert sent == [("q", True, None)] and s.pending() == 0 and r.pending() == 0
    finally:
        server.close()
        s.close()
        r.close()
