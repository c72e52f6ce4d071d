"""EngineLoop: background thread, callbacks, cancel, errors, shutdown (tiny random Llama)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from engine_helpers import (
    Listener,
    RemoteLoader,
    assert_pool_idle,
    build_tiny_llama,
    make_engine,
    run_to_completion,
    tokens_of,
)

from backend.engine.engine_loop import EngineLoop
from backend.engine.sampling_params import SamplingParams

TIMEOUT = 60


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama_loop"))


@pytest.fixture
def loop(tiny_dir):
    loop = EngineLoop(make_engine(tiny_dir, max_num_batched_tokens=16, kv_cache_tokens=1024, page_size=8))
    yield loop
    loop.shutdown()
    assert not loop.stats()["alive"]
    assert_pool_idle(loop.engine)


class Collector:
    """on_output callback that records outputs and signals the end."""

    def __init__(self):
        self.outputs = []
        self.done = threading.Event()
        self.threads = set()

    def __call__(self, output):
        self.threads.add(threading.current_thread().name)
        self.outputs.append(output)
        if output.finished:
            self.done.set()

    def wait(self):
        assert self.done.wait(TIMEOUT), "request did not finish"
        return self

    @property
    def tokens(self):
        return tokens_of(self.outputs)

    @property
    def last(self):
        return self.outputs[-1]


def test_concurrent_requests_stream_tokens_from_loop_thread(loop, tiny_dir):
    prompts = [[5, 6, 7], list(range(10, 50)), [9] * 20]
    collectors = [Collector() for _ in prompts]
    for i, (prompt, collector) in enumerate(zip(prompts, collectors)):
        loop.submit(f"r{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True), collector)
    for collector in collectors:
        collector.wait()
        assert len(collector.tokens) == 8 and collector.last.finish_reason == "length"
        assert [o.finished for o in collector.outputs] == [False] * 7 + [True]
        assert collector.threads == {"engine-loop"}
    reference = make_engine(tiny_dir)  # the same requests on a plain engine give the same tokens
    for i, prompt in enumerate(prompts):
        reference.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    expected = run_to_completion(reference)
    assert [c.tokens for c in collectors] == [tokens_of(expected[f"r{i}"]) for i in range(3)]
    stats = loop.stats()
    assert stats["steps"] >= 8 and stats["pool"]["used"] == 0 and stats["running"] == 0


def test_cancel_running_request(loop):
    first_token = threading.Event()
    collector = Collector()

    def on_output(output):
        collector(output)
        first_token.set()

    loop.submit("long", [3, 4, 5], SamplingParams(max_tokens=400, ignore_eos=True), on_output)
    assert first_token.wait(TIMEOUT)
    loop.cancel("long")
    collector.wait()
    assert collector.last.finish_reason == "abort" and len(collector.tokens) < 400


def test_invalid_request_answers_with_error(loop):
    collector = Collector()
    loop.submit("bad", [], SamplingParams(), collector)
    assert collector.wait().last.finish_reason == "error" and "must not be empty" in collector.last.error
    ok = Collector()
    loop.submit("dup", [5, 6], SamplingParams(max_tokens=300, ignore_eos=True), ok)
    dup = Collector()
    loop.submit("dup", [5, 6], SamplingParams(), dup)
    assert dup.wait().last.finish_reason == "error" and "already active" in dup.last.error
    loop.cancel("dup")
    assert ok.wait().last.finish_reason == "abort"


def test_step_exception_fails_requests_and_loop_survives(loop, monkeypatch):
    real_run = loop.engine.runner.run
    calls = {"n": 0}

    def flaky_run(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real_run(*args, **kwargs)

    monkeypatch.setattr(loop.engine.runner, "run", flaky_run)
    failed = Collector()
    loop.submit("a", [1, 2, 3], SamplingParams(max_tokens=4), failed)
    assert failed.wait().last.finish_reason == "error" and "boom" in failed.last.error
    assert loop.engine.pool_stats()["used"] == 0
    after = Collector()
    loop.submit("b", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), after)
    assert after.wait().last.finish_reason == "length" and len(after.tokens) == 4


def test_raising_callback_aborts_only_its_request(loop):
    def bad_callback(output):
        raise ValueError("client went away")

    loop.submit("bad", [7, 8], SamplingParams(max_tokens=300, ignore_eos=True), bad_callback)
    good = Collector()
    loop.submit("good", [7, 8], SamplingParams(max_tokens=6, ignore_eos=True), good)
    assert good.wait().last.finish_reason == "length"
    assert "bad" not in loop.engine.active_request_ids()


def test_shutdown_aborts_active_requests(tiny_dir):
    loop = EngineLoop(make_engine(tiny_dir, kv_cache_tokens=1024))
    started = threading.Event()
    collector = Collector()

    def on_output(output):
        collector(output)
        started.set()

    loop.submit("x", [4, 5], SamplingParams(max_tokens=450, ignore_eos=True), on_output)
    assert started.wait(TIMEOUT)
    loop.shutdown()
    assert collector.done.is_set() and collector.last.finish_reason == "abort"
    assert_pool_idle(loop.engine)
    with pytest.raises(RuntimeError, match="shut down"):
        loop.submit("y", [1], SamplingParams(), Collector())


def test_prefill_and_decode_roles_through_two_loops(tiny_dir):
    """Prefill loop streams pages (per-layer hook) into pages reserved through the decode loop."""
    settings = dict(max_num_batched_tokens=16, kv_cache_tokens=1024, page_size=8)
    prefill = EngineLoop(make_engine(tiny_dir, **settings), name="prefill-loop")
    decode = EngineLoop(make_engine(tiny_dir, **settings), name="decode-loop")
    reference = make_engine(tiny_dir, **settings)
    prompt = list(range(20, 61))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    reference.add_request("r", prompt, params)
    expected = tokens_of(run_to_completion(reference)["r"])

    loader = RemoteLoader()
    decode.engine.set_kv_loader(loader)
    tokens = Collector()
    decode.submit("r", prompt, params, tokens, remote_kv=True)  # the decode side allocates first
    deadline = time.monotonic() + 10
    while "r" not in loader.pages:
        assert time.monotonic() < deadline, "the decode loop never admitted the request"
        time.sleep(0.01)
    dst_pages = loader.pages["r"]

    def copy_layer(layer_idx, step_batch):
        for chunk in step_batch.prefill_only_chunks:
            first = chunk.start // 8
            dst = torch.tensor(dst_pages[first : first + len(chunk.page_ids)])
            decode.engine.pool.layer(layer_idx)[dst] = prefill.engine.pool.layer(layer_idx)[chunk.page_ids]

    prefill.engine.set_kv_listener(Listener(on_layer=copy_layer))
    done = Collector()
    prefill.submit("r", prompt[:-1], None, done, prefill_only=True)
    out = done.wait().last
    assert out.finish_reason == "prefill_done" and out.hidden_state is not None and out.new_token_ids == []
    assert prefill.engine.pool_stats()["used"] == 5  # held until released
    prefill.release("r")
    decode.kv_loaded("r")
    assert tokens.wait().tokens == expected and tokens.last.finish_reason == "length"
    for loop in (prefill, decode):
        loop.shutdown()
        assert_pool_idle(loop.engine)


def test_a_stalled_loop_waits_for_a_command_instead_of_spinning(tiny_dir):
    """A request waiting for its KV holds the whole pool; the next one cannot be admitted until a
    command frees pages: the loop waits (a few steps, not hundreds of thousands a second)."""
    engine = make_engine(tiny_dir, max_num_batched_tokens=16, kv_cache_tokens=96, page_size=8)
    loader = RemoteLoader()
    engine.set_kv_loader(loader)
    loop = EngineLoop(engine, name="stall-loop")
    first, second = Collector(), Collector()
    big = SamplingParams(max_tokens=60, ignore_eos=True)
    loop.submit("holds", list(range(3, 33)), big, first, remote_kv=True)
    deadline = time.monotonic() + 10
    while "holds" not in loader.pages:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    loop.submit("waits", list(range(40, 70)), big, second, remote_kv=True)
    time.sleep(0.2)
    steps = loop.stats()["steps"]
    time.sleep(0.5)
    assert loop.stats()["steps"] - steps <= 3, "the stalled loop kept stepping"
    loop.cancel("holds")
    loop.release("holds")  # no transfer was started for it: its pages may go at once
    assert first.wait().last.finish_reason == "abort"
    deadline = time.monotonic() + 10
    while "waits" not in loader.pages:  # admitted once the pages came back
        assert time.monotonic() < deadline
        time.sleep(0.01)
    loop.cancel("waits")
    loop.release("waits")
    assert second.wait().last.finish_reason == "abort"
    loop.shutdown()
    assert_pool_idle(engine)
