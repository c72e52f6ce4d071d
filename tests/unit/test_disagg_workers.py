"""Decode and prefill workers end to end in one process, without NIXL: a tiny random model, the
fake NIXL (``tests/fake_nixl.py``) moving the KV bytes, and the real messenger over loopback TCP.
Covers the request state machine of both roles (``backend/serving/request_state.py``): outputs
equal an aggregated engine's; cancel and peer loss in every state; a completion after a cancel; a
duplicate completion; layer completions out of order; a refused prefill; waiting for pages and
for a prefill instance. After each test both pools are free again (no page leaked)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
from engine_helpers import build_tiny_llama, make_engine, run_to_completion, tokens_of

from backend.engine.cache_summary import CacheSummary
from backend.engine.outputs import ErrorKind
from backend.engine.sampling_params import SamplingParams
from backend.serving.config import InstanceConfig
from backend.serving.decode_worker import DecodeWorker
from backend.serving.detokenizer import IncrementalDetokenizer
from backend.serving.prefill_worker import PrefillWorker
from backend.serving.request import ClientRequest
from backend.serving.request_state import DecodeState
from backend.serving.session import GenerationSession

PAGE = 8
BASE = {
    "page_size": str(PAGE),
    "kv_cache_tokens": "1024",
    "max_num_batched_tokens": "16",
    "max_model_len": "256",
    "kv_quarantine_s": "1",
    "cache_report_interval_s": "0.1",
    "local_prefill_max_tokens": "0",
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_workers"))


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setenv("TRITON_DISAGG_DEPLOYMENT_SECRET", "unit-test-secret-0123456789")


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + 7 * i) % 250 + 3 for i in range(n)]


def reference(tiny_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = make_engine(tiny_dir, page_size=PAGE, max_num_batched_tokens=16)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    done = run_to_completion(engine)
    return [tokens_of(done[str(i)]) for i in range(len(prompts))]


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"<{i}>" for i in ids)


class Sink:
    """A client stream: what it was sent, its error (``failed``), whether it went away."""

    def __init__(self):
        self.tokens: list[int] = []
        self.final = False
        self.finish_reason = ""
        self.failed: tuple[str, ErrorKind] | None = None
        self.closed = False
        self.gone = False

    def send(self, text, token_ids, n_input, n_output, finish_reason, final, extras=None) -> None:
        self.tokens.extend(token_ids)
        self.final, self.finish_reason = final, finish_reason

    def error(self, message, kind) -> None:
        self.failed = (message, kind)

    def close(self) -> None:
        self.closed = True

    def is_cancelled(self) -> bool:
        return self.gone

    @property
    def ended(self) -> bool:
        return self.final or self.failed is not None or self.closed


def session(worker, req_id: str, ids: list[int], max_tokens: int = 8) -> tuple[GenerationSession, Sink]:
    sink = Sink()
    request = ClientRequest(text="", max_tokens=max_tokens, stream=True, ignore_eos=True)
    s = GenerationSession(req_id, request, ids, sink, IncrementalDetokenizer(FakeTokenizer()), worker.cancel)
    return s, sink


def wait_until(cond: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what or cond}"
        time.sleep(0.01)


def pool_free(worker) -> bool:
    s = worker.engine.pool_stats()
    return s["free"] == s["total"] and s["requests"] == 0


class Pair:
    """One prefill worker and one decode worker connected to it."""

    def __init__(self, tiny_dir, decode_overrides: dict | None = None, prefill_overrides: dict | None = None):
        self.prefill = PrefillWorker(
            InstanceConfig.from_parameters(
                {"role": "prefill", "model_path": str(tiny_dir), **BASE, **(prefill_overrides or {})}
            ),
            "unit-prefill",
        )
        endpoint = f"127.0.0.1:{self.prefill.server.port}"
        self.decode = DecodeWorker(
            InstanceConfig.from_parameters(
                {
                    "role": "decode",
                    "model_path": str(tiny_dir),
                    "prefill_endpoints": endpoint,
                    **BASE,
                    **(decode_overrides or {}),
                }
            ),
            "unit-decode",
        )
        wait_until(lambda: self.decode.health() is None, what="the decode worker to connect")

    def run(self, ids: list[int], req_id: str, max_tokens: int = 8) -> tuple[GenerationSession, Sink]:
        s, sink = session(self.decode, req_id, ids, max_tokens)
        self.decode.submit(s)
        return s, sink

    def run_all(self, prompts: list[list[int]], tag: str, max_tokens: int) -> list[Sink]:
        """Submit every prompt at once; wait until each has ended."""
        sinks = [self.run(x, f"{tag}{i}", max_tokens)[1] for i, x in enumerate(prompts)]
        for sink in sinks:
            wait_until(lambda sink=sink: sink.ended)
        return sinks

    def assert_idle(self, timeout: float = 20.0) -> None:
        wait_until(lambda: pool_free(self.decode) and pool_free(self.prefill), timeout, "both pools to be free")
        wait_until(lambda: not self.decode.requests and not self.prefill.requests, timeout, "no request state left")

    def close(self) -> None:
        self.decode.shutdown()
        self.prefill.shutdown()


@pytest.fixture
def pair(tiny_dir):
    p = Pair(tiny_dir)
    yield p
    p.close()


def test_disaggregated_outputs_equal_aggregated(pair, tiny_dir):
    prompts = [prompt(40, 1), prompt(9, 2), prompt(65, 3)]
    runs = [pair.run(p, f"r{i}", 10) for i, p in enumerate(prompts)]
    for _, sink in runs:
        wait_until(lambda sink=sink: sink.ended)
    assert [sink.tokens for _, sink in runs] == reference(tiny_dir, prompts, 10)
    assert all(sink.finish_reason == "length" and sink.failed is None for _, sink in runs)
    pair.assert_idle()
    stats = pair.decode.stats()
    assert stats.prefill_remote_total == 3 and stats.prefill_local_total == 0
    assert stats.kv_writes_total > 0 and stats.prefill_endpoints_connected == 1
    assert pair.prefill.stats().prefills_total == 3
    assert pair.decode.observations()["kv_transfer_time_seconds"]
    # a repeated prompt whose pages but the last token's are in the decode instance's own prefix
    # cache (65 tokens: 8 full pages) needs no prefill instance
    s, sink = pair.run(prompts[2], "again", 10)
    wait_until(lambda: sink.ended)
    assert sink.tokens == runs[2][1].tokens and pair.decode.stats().prefill_local_total == 1
    pair.assert_idle()
    # what its membership record tells routers: it serves, and the prompt's pages are cached here
    state = pair.decode.published_state()
    summary = CacheSummary.from_json(json.loads(state["cache"]))
    assert state["health"] == "" and summary == pair.decode.cache_summary() and summary.keys


def test_layer_completions_out_of_order_and_duplicated(pair, tiny_dir, fabric):
    import random

    fabric.auto = False  # every xfer waits for the test
    # notifications other than write counts arrive twice (a write count is counted, so NIXL's
    # exactly-once delivery of it is assumed: see fabric_bridge/README.md)
    fabric.notif_filter = lambda sender, target, msg: [msg] if msg.startswith(b"W") else [msg, msg]
    ids = prompt(60, 4)
    s, sink = pair.run(ids, "ooo", 6)
    rng = random.Random(7)
    deadline = time.monotonic() + 20
    while not sink.ended:
        fabric.complete(shuffle=rng)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert sink.failed is None and sink.tokens == reference(tiny_dir, [ids], 6)[0]
    pair.assert_idle()
    # a duplicate completion reaching the decode loop after the request ended changes nothing
    from backend.serving.decode_worker import KVDone, KVReleased

    pair.decode._events.put(KVDone("ooo", True, None, None))
    pair.decode._events.put(KVReleased("ooo"))
    fabric.auto, fabric.notif_filter = True, None
    _, after = pair.run(ids, "after-duplicates", 6)
    wait_until(lambda: after.ended)
    assert after.tokens == sink.tokens
    pair.assert_idle()


def test_cancel_while_the_kv_is_in_flight_then_late_completions(pair, fabric):
    fabric.auto = False
    s, sink = pair.run(prompt(60, 5), "c1")
    wait_until(lambda: fabric.held, what="a write in flight")
    assert pair.decode.requests["c1"].state.state is DecodeState.WAITING_KV
    pair.decode.cancel("c1")
    wait_until(lambda: sink.ended)
    assert sink.tokens == [] and sink.failed is None  # a client cancel is not an error
    fabric.complete()  # writes that were in flight land after the cancel: ignored
    fabric.auto = True
    pair.assert_idle()


def test_client_gone_while_waiting_for_kv(pair, fabric):
    fabric.auto = False
    s, sink = pair.run(prompt(60, 6), "gone")
    wait_until(lambda: fabric.held, what="a write in flight")
    sink.gone = True  # noticed by the decode loop's poll, as a Triton cancellation
    wait_until(lambda: "gone" not in pair.decode.requests or pair.decode.requests["gone"].cancelled)
    fabric.complete()
    fabric.auto = True
    pair.assert_idle()
    assert sink.tokens == []


def test_cancel_while_queued_for_pages_and_while_running(tiny_dir, fabric):
    # a pool for one request at a time: while the first waits for its KV (held by the test), the
    # second waits for pages in the engine's queue
    p = Pair(tiny_dir, decode_overrides={"kv_cache_tokens": "96", "max_waiting_for_pages": "4"})
    try:
        fabric.auto = False
        _, first = p.run(prompt(30, 7), "holds", 60)
        wait_until(lambda: fabric.held, what="a write in flight")
        _, second = p.run(prompt(30, 8), "waits", 60)
        wait_until(lambda: "waits" in p.decode.requests)
        time.sleep(0.1)  # a few engine steps: it stays queued
        assert p.decode.requests["waits"].state.state is DecodeState.QUEUED
        p.decode.cancel("waits")
        wait_until(lambda: second.ended)
        assert second.tokens == [] and second.failed is None
        fabric.auto = True
        fabric.complete()
        wait_until(lambda: first.ended)
        assert first.failed is None and len(first.tokens) == 60
        _, running = p.run(prompt(10, 9), "runs", 80)
        wait_until(lambda: running.tokens, what="the first token")
        p.decode.cancel("runs")
        wait_until(lambda: running.ended)
        assert running.failed is None and len(running.tokens) < 80
        p.assert_idle()
    finally:
        p.close()


def test_waiting_for_pages_has_a_bound_and_a_deadline(tiny_dir, fabric):
    p = Pair(
        tiny_dir, decode_overrides={"kv_cache_tokens": "96", "max_waiting_for_pages": "1", "page_wait_timeout_s": "0.5"}
    )
    try:
        fabric.auto = False  # the first request holds the pool while it waits for its KV
        _, first = p.run(prompt(30, 9), "holds", 60)
        wait_until(lambda: fabric.held, what="a write in flight")
        _, waits = p.run(prompt(30, 10), "waits", 60)
        wait_until(lambda: "waits" in p.decode.requests)
        _, refused = p.run(prompt(30, 11), "refused", 60)
        wait_until(lambda: refused.ended and waits.ended, timeout=10)
        assert refused.failed is not None and refused.failed[1] is ErrorKind.OVERLOADED
        assert "already waiting for pages" in refused.failed[0]
        assert waits.failed is not None and waits.failed[1] is ErrorKind.OVERLOADED, waits.failed
        assert "within" in waits.failed[0]
        fabric.auto = True
        fabric.complete()
        wait_until(lambda: first.ended)
        assert first.failed is None
        p.assert_idle()
    finally:
        p.close()


FAIL = {"kv_load_failure_policy": "fail"}


def test_prefill_instance_lost_while_the_kv_is_in_flight(tiny_dir, fabric):
    p = Pair(tiny_dir, decode_overrides=FAIL)
    try:
        fabric.auto = False
        _, sink = p.run(prompt(60, 12), "lost")
        wait_until(lambda: fabric.held, what="a write in flight")
        fabric.kill("unit-prefill")  # its process dies: writes never land, NIXL calls to it fail
        p.prefill.server.close()  # ... and its messenger connections drop
        wait_until(lambda: sink.ended)
        assert sink.failed is not None and sink.failed[1] is ErrorKind.KV_TRANSFER_FAILED
        assert "lost" in sink.failed[0], sink.failed
        wait_until(lambda: pool_free(p.decode), what="the decode pool to be free")  # after the quarantine
        wait_until(lambda: not p.decode.requests)
    finally:
        p.close()


def test_a_refused_prefill_fails_its_request_alone(tiny_dir):
    # a prefill instance configured for shorter contexts refuses what it cannot hold
    p = Pair(tiny_dir, decode_overrides=FAIL, prefill_overrides={"max_model_len": "32"})
    try:
        _, ok = p.run(prompt(20, 17), "fits")
        _, sink = p.run(prompt(40, 18), "too-long")
        wait_until(lambda: sink.ended and ok.ended)
        assert sink.failed is not None and sink.failed[1] is ErrorKind.KV_TRANSFER_FAILED, sink.failed
        assert "must be 1..31" in sink.failed[0], sink.failed
        assert ok.failed is None and len(ok.tokens) == 8
        p.assert_idle()
    finally:
        p.close()


def test_no_prefill_instance_reachable(tiny_dir):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    decode = DecodeWorker(
        InstanceConfig.from_parameters(
            {
                "role": "decode",
                "model_path": str(tiny_dir),
                "prefill_endpoints": f"127.0.0.1:{port}",
                "prefill_connect_wait_s": "0.5",
                **BASE,
            }
        ),
        "unit-decode-alone",
    )
    try:
        assert "no prefill instance connected" in (decode.health() or "")
        assert decode.published_state()["health"] == decode.health()  # routers read it in its record
        s1, sink = session(decode, "nobody", prompt(40, 13))
        decode.submit(s1)
        s2, cancelled = session(decode, "cancelled", prompt(40, 14))
        decode.submit(s2)
        wait_until(lambda: "cancelled" in decode.requests and decode.requests["cancelled"].pages)
        decode.cancel("cancelled")
        wait_until(lambda: sink.ended and cancelled.ended)
        assert sink.failed is not None and sink.failed[1] is ErrorKind.PREFILL_UNAVAILABLE, sink.failed
        assert cancelled.failed is None and cancelled.tokens == []
        wait_until(lambda: pool_free(decode) and not decode.requests)
    finally:
        decode.shutdown()


def test_short_prompts_are_prefilled_here(tiny_dir):
    p = Pair(tiny_dir, decode_overrides={"local_prefill_max_tokens": "32"})
    try:
        ids = [prompt(20, 15), prompt(60, 16)]
        sinks = p.run_all(ids, "l", 5)
        assert [sink.tokens for sink in sinks] == reference(tiny_dir, ids, 5)
        stats = p.decode.stats()
        assert (stats.prefill_local_total, stats.prefill_remote_total) == (1, 1)
        p.assert_idle()
    finally:
        p.close()


def test_messenger_connection_lost_mid_transfer_frees_both_sides(tiny_dir, fabric):
    pair = Pair(tiny_dir, decode_overrides=FAIL)
    try:
        _messenger_cut(pair, fabric)
    finally:
        pair.close()


def _messenger_cut(pair, fabric):
    fabric.auto = False
    _, sink = pair.run(prompt(60, 19), "cut")
    wait_until(lambda: fabric.held, what="a write in flight")
    assert "cut" in pair.prefill.requests
    conn = pair.decode.endpoints[0]._conn
    assert conn is not None
    conn.close("cut by the test")  # both workers see the connection drop
    wait_until(lambda: sink.ended)
    assert sink.failed is not None and sink.failed[1] is ErrorKind.KV_TRANSFER_FAILED and "lost" in sink.failed[0]
    fabric.complete()  # what was in flight lands late: ignored by the receiver
    fabric.auto = True
    pair.assert_idle()
    wait_until(lambda: pair.decode.health() is None, what="the endpoint to reconnect")
    _, again = pair.run(prompt(30, 20), "after")
    wait_until(lambda: again.ended)
    assert again.failed is None and len(again.tokens) == 8
    pair.assert_idle()


def test_no_free_receive_slot_is_overloaded_not_stuck(tiny_dir, fabric):
    p = Pair(tiny_dir, decode_overrides={"meta_slots": "1"})
    try:
        fabric.auto = False
        _, first = p.run(prompt(40, 21), "slot")
        wait_until(lambda: fabric.held, what="a write in flight")
        _, second = p.run(prompt(40, 22), "no-slot")
        wait_until(lambda: second.ended)
        assert second.failed is not None and second.failed[1] is ErrorKind.OVERLOADED, second.failed
        assert "meta slot" in second.failed[0]
        fabric.auto = True
        fabric.complete()
        wait_until(lambda: first.ended)
        assert first.failed is None and len(first.tokens) == 8
        p.assert_idle()
    finally:
        p.close()


# ---------------------------------------------------------------- kv_load_failure_policy=recompute (the default)
def test_a_lost_prefill_instance_is_recomputed_here(tiny_dir, fabric):
    p = Pair(tiny_dir)
    try:
        ids = prompt(60, 23)
        fabric.auto = False
        _, sink = p.run(ids, "recomputed", 8)
        wait_until(lambda: fabric.held, what="a write in flight")
        fabric.kill("unit-prefill")  # its process dies mid-transfer
        p.prefill.server.close()
        wait_until(lambda: "recomputed" in p.decode.requests and p.decode.requests["recomputed"].tried)
        assert p.decode.requests["recomputed"].state.state is DecodeState.RECOVERING  # pages still quarantined
        wait_until(lambda: sink.ended)
        assert sink.failed is None, sink.failed
        assert sink.tokens == reference(tiny_dir, [ids], 8)[0]
        stats = p.decode.stats()
        assert stats.kv_loads_recomputed_total == 1 and stats.prefill_local_total == 1
        wait_until(lambda: pool_free(p.decode) and not p.decode.requests, what="the decode pool to be free")
    finally:
        p.close()


def test_a_refused_prefill_is_recomputed_here(tiny_dir):
    p = Pair(tiny_dir, prefill_overrides={"max_model_len": "32"})
    try:
        ids = [prompt(20, 24), prompt(40, 25)]
        sinks = p.run_all(ids, "r", 6)
        assert [sink.failed for sink in sinks] == [None, None]
        assert [sink.tokens for sink in sinks] == reference(tiny_dir, ids, 6)
        assert p.decode.stats().kv_loads_recomputed_total == 1
        p.assert_idle()
    finally:
        p.close()


def test_a_cut_messenger_connection_is_recomputed(tiny_dir, pair, fabric):
    fabric.auto = False
    ids = prompt(60, 26)
    _, sink = pair.run(ids, "cut-recompute")
    wait_until(lambda: fabric.held, what="a write in flight")
    pair.decode.endpoints[0]._conn.close("cut by the test")
    fabric.complete()  # late writes land in the quarantined pages, then get recomputed over
    fabric.auto = True
    wait_until(lambda: sink.ended)
    assert sink.failed is None and sink.tokens == reference(tiny_dir, [ids], 8)[0]
    pair.assert_idle()


# ---------------------------------------------------------------- membership: prefill instances join and leave
def _record(address: str, name: str, draining: bool = False):
    from backend.cluster.records import InstanceRecord

    return InstanceRecord("default", name, "prefill", "", "", address, "m", "l", 1, 0.0, draining)


def test_prefill_instances_join_drain_and_leave(tiny_dir, fabric):
    from backend.serving.decode_worker import PrefillsChanged

    p = Pair(tiny_dir)
    second = PrefillWorker(
        InstanceConfig.from_parameters({"role": "prefill", "model_path": str(tiny_dir), **BASE}), "unit-prefill-2"
    )
    try:
        first_address = p.decode.endpoints[0].address
        joined = _record(f"127.0.0.1:{second.server.port}", "second")
        p.decode._events.put(PrefillsChanged([joined], []))
        wait_until(lambda: sum(e.connected for e in p.decode.endpoints) == 2, what="the second prefill to connect")
        # the first drains: requests go to the second only; its record then leaves
        p.decode._events.put(PrefillsChanged([_record(first_address, "first", draining=True)], []))
        wait_until(lambda: all(e.address != first_address for e in p.decode.endpoints), what="the first to close")
        sinks = p.run_all([prompt(30, 27), prompt(40, 28)], "after-drain", 6)
        assert [s.failed for s in sinks] == [None, None]
        assert p.decode.stats().prefill_endpoints_connected == 1 and not p.prefill.requests
        # the second leaves while a transfer is in flight: no new requests go there, the one in
        # flight is recomputed once its connection closes (the decode instance is now alone)
        fabric.auto = False
        _, sink = p.run(prompt(60, 29), "in-flight", 6)
        wait_until(lambda: fabric.held, what="a write in flight")
        p.decode._events.put(PrefillsChanged([], [joined]))
        time.sleep(0.3)
        assert p.decode.endpoints and "no prefill instance connected" in (p.decode.health() or "")
        second.server.close()  # its process goes away
        fabric.auto = True
        fabric.complete()
        wait_until(lambda: sink.ended)
        assert sink.failed is None and sink.tokens == reference(tiny_dir, [prompt(60, 29)], 6)[0]
        wait_until(lambda: not p.decode.endpoints, what="the retired endpoint to close once idle")
        wait_until(lambda: pool_free(p.decode) and not p.decode.requests)
    finally:
        second.shutdown()
        p.close()


def test_a_prefill_instance_restarted_at_its_address_keeps_serving_when_its_old_record_leaves(tiny_dir, fabric):
    """The restarted instance registers (a new name, the same address) before the old record's
    lease lapses; the old record's leave then must not retire the address."""
    from backend.serving.decode_worker import PrefillsChanged

    p = Pair(tiny_dir)
    try:
        address = p.decode.endpoints[0].address
        old = _record(address, address)  # the name a fixed endpoint's record has
        p.decode._events.put(PrefillsChanged([_record(address, "restarted")], []))
        p.decode._events.put(PrefillsChanged([], [old]))
        sinks = p.run_all([prompt(30, 31)], "after-restart", 6)
        assert [s.failed for s in sinks] == [None]
        assert [e.address for e in p.decode.endpoints] == [address] and not p.decode._retired
        p.decode._events.put(PrefillsChanged([], [_record(address, "restarted")]))  # the new one leaves
        wait_until(lambda: not p.decode.endpoints, what="the address to retire and close")
    finally:
        p.close()


def test_the_responder_keeps_the_engine_order_and_one_failing_session_stops_nothing(caplog):
    """Engine outputs reach their sessions on the responder's thread, in the engine's order (a
    session's tokens as made, finals last); a session that raises is logged and the next ones
    are served; ``close`` sends what is queued first."""
    from backend.engine.outputs import EngineOutput, FinishReason
    from backend.serving.worker import Responder

    class Broken:
        req_id = "broken"

        def on_output(self, *args, **kwargs):
            raise RuntimeError("a session that fails")

    cancelled: list[str] = []
    responder = Responder("unit", backlog=4)  # the engine thread waits past 4 outputs in line
    a, sink_a = session(type("W", (), {"cancel": cancelled.append})(), "a", [1, 2, 3], max_tokens=50)
    b, sink_b = session(type("W", (), {"cancel": cancelled.append})(), "b", [1, 2, 3], max_tokens=50)
    for i in range(50):
        last = i == 49
        responder.deliver(a, EngineOutput("a", [i], last, FinishReason.LENGTH if last else None))
        if i == 10:
            responder.deliver(Broken(), EngineOutput("broken", [0]))  # type: ignore[arg-type]
        responder.deliver(b, EngineOutput("b", [100 + i], last, FinishReason.LENGTH if last else None))
    responder.close()
    assert sink_a.tokens == list(range(50)) and sink_a.final and sink_a.finish_reason == "length"
    assert sink_b.tokens == [100 + i for i in range(50)] and sink_b.final and not cancelled
    logged = [r.getMessage() for r in caplog.records]
    assert any("request broken: handing an engine output to its session failed" in m for m in logged)
