"""A layer's KV is posted only after the device has written it.

The prefill engine runs with a device stand-in (``GatedProgress``): its marks (one per layer
of each step, one when the sender asks for the step's end) complete only when the test
releases them, as a GPU would finish queued kernels late. A sender and receiver in this
process move the pages over the fake NIXL of ``tests/fake_nixl.py``, which copies the bytes
(real NIXL moves them in the disaggregated server tests). The posts must wait for the marks, in
order, the meta block must wait for the step-end mark, the prefill's pages must stay unfreeable until
every write is done, and the bytes that land in the decode pool must equal the prefill pool's.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from engine_helpers import admit_remote, build_tiny_llama

from backend.disagg.config import ConnectorConfig  # noqa: E402
from backend.disagg.connector import SendRequest  # noqa: E402
from backend.disagg.nixl_connector import NixlKVReceiver, NixlKVSender
from backend.engine.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.engine.model_runner import ModelRunner
from backend.engine.outputs import FinishReason

PAGE = 8
N_TOKENS = 40  # prefilled (the prompt is one longer): 5 pages, computed in two chunks (24 + 16)


class GatedProgress:
    """A device that finishes queued work only when the test says so (marks in issue order)."""

    def __init__(self):
        self.issued = self.released = 0
        self.cv = threading.Condition()

    def mark(self):
        with self.cv:
            self.issued += 1
            return GatedMark(self, self.issued)

    def release(self, n: int = 1) -> None:
        with self.cv:
            self.released += n
            self.cv.notify_all()


class GatedMark:
    def __init__(self, progress: GatedProgress, target: int):
        self.progress, self.target = progress, target

    def done(self) -> bool:
        return self.progress.released >= self.target

    def wait(self, timeout_s=None) -> bool:
        with self.progress.cv:
            return self.progress.cv.wait_for(self.done, timeout_s)


def wait_until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def stays(predicate, seconds=0.3):
    """``predicate`` holds now and for ``seconds`` (nothing is posted behind the test's back)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not predicate():
            return False
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def make_pair(tmp_path):
    """``make_pair(device_timeout_s)``: a gated prefill engine with its sender, a decode engine
    with its receiver, connected both ways."""
    made = []

    def make(device_timeout_s: float):
        made.append(_pair(tmp_path, device_timeout_s))
        return made[-1]

    yield make
    for _, _, _, sender, receiver, *_ in made:
        sender.close()
        receiver.close()


def _pair(tmp_path, device_timeout_s):
    model = build_tiny_llama(tmp_path / "tiny")
    config = EngineConfig(
        model_path=str(model), page_size=PAGE, kv_cache_tokens=512, max_num_batched_tokens=24, max_model_len=256
    )
    gate = GatedProgress()
    prefill = LLMEngine(config, runner=ModelRunner(config, progress=gate))
    decode = LLMEngine(config)
    errors = []
    connector = ConnectorConfig(kv_xfer_timeout_s=device_timeout_s)
    sender = NixlKVSender(prefill, connector, "order-prefill", lambda r, e: errors.append((r, e)), lambda request: None)
    receiver = NixlKVReceiver(decode, connector, "order-decode")
    to_decode = sender.add_peer(receiver.handshake_payload())
    to_prefill = receiver.add_peer(sender.handshake_payload())
    return gate, prefill, decode, sender, receiver, to_decode, to_prefill, errors


def start(prefill, decode, sender, receiver, to_decode, to_prefill, req_id="r0"):
    prompt = [(7 * i + 3) % 250 + 3 for i in range(N_TOKENS + 1)]
    dst = admit_remote(decode, req_id, prompt)[: math.ceil(N_TOKENS / PAGE)]
    ready, got = threading.Event(), {}

    def on_ready(rid, ok, err, meta):
        got.update(ok=ok, err=err, meta=meta)
        ready.set()

    ticket = receiver.expect(req_id, N_TOKENS, (to_prefill, sender.layout), on_ready, lambda rid: None)
    sender.add_request(SendRequest(req_id, to_decode, ticket.generation, ticket.slot, N_TOKENS, dst))
    receiver.started(req_id, ticket.generation)
    prefill.add_request(req_id, prompt[:-1], prefill_only=True)
    return dst, ready, got


def test_posts_wait_for_the_device_and_bytes_match(make_pair):
    gate, prefill, decode, sender, receiver, to_decode, to_prefill, errors = make_pair(30.0)
    dst, ready, got = start(prefill, decode, sender, receiver, to_decode, to_prefill)
    writes = lambda: sender.stats()["kv_writes_total"]  # noqa: E731

    assert prefill.step() == []  # chunk 1: pages 0-2 complete, layers 0 and 1 queued (marks 1, 2)
    assert gate.issued == 2
    assert stays(lambda: writes() == 0), "a layer was posted before the device wrote it"
    gate.release(1)  # the device has written layer 0 of chunk 1
    assert wait_until(lambda: writes() > 0)
    layer_writes = writes()  # one layer of three pages
    assert stays(lambda: writes() == layer_writes), "layer 1 was posted before the device wrote it"

    (out,) = prefill.step()  # chunk 2: pages 3-4 (marks 3, 4)
    assert out.finish_reason == FinishReason.PREFILL_DONE
    freeable = threading.Event()
    sender.request_finished(out, lambda rid, ok, err: freeable.set())  # step-end mark 5
    assert gate.issued == 5
    assert stays(lambda: writes() == layer_writes and not freeable.is_set())
    gate.release(3)  # layer 1 of chunk 1, both layers of chunk 2
    assert wait_until(lambda: sender.stats()["kv_writes_total"] == layer_writes * 2 * 5 // 3)
    assert stays(lambda: not ready.is_set() and not freeable.is_set()), "meta or finish ran before the step ended"
    gate.release(1)
    assert ready.wait(10) and got["ok"], got
    assert freeable.wait(10)
    assert sender.stats()["kv_posts_deferred_total"] == 6  # 4 layer posts, the meta block, finish_send
    assert not errors

    src = prefill.page_table("r0")[: len(dst)]
    sent = prefill.kv_cache().shards[0][:, src]
    landed = decode.kv_cache().shards[0][:, dst]
    assert torch.equal(sent, landed)
    assert bool(sent.abs().sum() > 0)
    hidden, logits = got["meta"]
    assert torch.equal(hidden, out.hidden_state.float()) and torch.equal(logits, out.logits.float())
    prefill.release("r0")


def test_a_device_that_never_finishes_fails_the_request_and_frees_its_pages(make_pair):
    gate, prefill, decode, sender, receiver, to_decode, to_prefill, errors = make_pair(0.5)
    dst, ready, got = start(prefill, decode, sender, receiver, to_decode, to_prefill, "r1")
    prefill.step()
    (out,) = prefill.step()
    freeable = {}
    done = threading.Event()

    def on_freeable(rid, ok, err):
        freeable.update(ok=ok, err=err)
        done.set()

    sender.request_finished(out, on_freeable)
    assert done.wait(30), "pages of a request stuck on the device were never released"
    assert not freeable["ok"] and "did not finish writing the KV" in freeable["err"], freeable
    assert errors and errors[0][0] == "r1" and "did not finish writing the KV" in errors[0][1]
    assert sender.stats()["kv_writes_total"] == 0
    assert ready.wait(10) and not got["ok"], got  # told that the sender stopped, long before its deadline
    prefill.release("r1")
