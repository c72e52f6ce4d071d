"""Requests that outlive their instance, on a real tritonserver (2 prefill + 2 decode instances,
the front model ``llm``), real NIXL and the real model:

- kill -9 of the decode instance serving half of 8 greedy streams after about 30 tokens: every
  stream completes, each equal to transformers' greedy output (no token repeated or missing),
  the pools come back to free and ``triton_disagg_migrations_total`` counts the moves;
- a ``guided_json`` stream on the same instance moves too: valid against its schema and equal
  to an uninterrupted run;
- kill -9 of a prefill instance while it prefills 4 long prompts: all 4 complete with the
  output of an uninterrupted run (the decode instances compute the failed loads again);
- ``triton-disagg drain`` of a decode instance whose streams outlast its drain window: the ones
  it ends at the window move to the other decode instance and complete equal to transformers'
  (run last: the drained instance has left the membership).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import numpy as np
import pytest

from backend.client import ConcurrentStreams, stream_generate
from backend.serving.request import prompt_token_ids
from tests.conftest import (
    PROMPTS,
    deployment_server,
    hf_greedy,
    metric_values,
    settled_metric,
    wait_metric,
    wait_pool_free,
)

pytestmark = pytest.mark.usefixtures("nixl")

MODELS = ["prefill_0", "prefill_1", "decode_0", "decode_1"]
N_TOKENS = 160
DRAIN_TOKENS = 400  # test_streams_a_drain_ends_at_its_window_move's (its docstring says why)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with deployment_server(
        tmp_path_factory,
        "migration",
        timeout_s=400,
        mode="disagg",
        model_path=str(model_dir),
        prefill_instances=2,
        decode_instances=2,
        overrides={
            "kv_cache_tokens": "8192",
            "num_threads": "1",
            "max_num_batched_tokens": "256",
            "kv_transfer_timeout_s": "15",
            "kv_quarantine_s": "3",
        },
        # decode_1's drain window is short, so the drain test's streams outlast it
        per_model={"front": {"health_probe_interval_s": "0.5"}, "decode_1": {"drain_timeout_s": "2"}},
    ) as s:
        yield s


def active(server, model: str) -> int:
    return int(sum(metric_values(server.metrics_url, "triton_disagg_requests_active", model=model)))


def migrations(server) -> float:
    return sum(metric_values(server.metrics_url, "triton_disagg_migrations_total", model="llm"))


def wait_serving(server, model: str, old_pid: int, timeout_s: float = 240) -> None:
    """Until the supervisor has reloaded ``model`` (a new stub) and the front routes to it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = server.instance_pids().get(f"{model}_0_0")
        # a prefill model has no such gauge: its reload is enough
        up = metric_values(server.metrics_url, "triton_disagg_decode_target_up", target=model) or [1.0]
        if pid not in (None, old_pid) and min(up) == 1.0:
            return
        time.sleep(0.5)
    raise AssertionError(f"{model} was not reloaded within {timeout_s}s")


def kill_when(server, model: str, cond, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"never ready to kill {model}"
        time.sleep(0.05)
    pid = server.instance_pids()[f"{model}_0_0"]
    os.kill(pid, signal.SIGKILL)
    return pid


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "cities": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 12, "maxItems": 12},
        "coastal": {"type": "boolean"},
    },
    "required": ["name", "cities", "coastal"],
}
GUIDED_PROMPT = "Describe France as JSON with twelve of its cities."


def test_streams_move_when_their_decode_instance_is_killed(server, tokenizer, hf_model):
    """One kill -9 (each kill of a stub risks Triton's own crash, see the README): the decode
    instance serving a guided_json stream and about half of 8 greedy streams dies once the
    greedy streams have 30 tokens (or the guided stream half its tokens, whichever comes first: on
    a slow machine the guided stream could otherwise end before the kill); every stream completes
    as if nothing happened, and the front counts exactly the moves the streams report."""
    guided = {"guided_json": (np.array([json.dumps(SCHEMA).encode()], dtype=object), "BYTES")}
    whole = stream_generate(server.grpc_url, GUIDED_PROMPT, 400, extra=guided, chat=True, timeout_s=300)
    assert whole.error is None and len(whole.token_ids) > 80, whole.error
    for m in ("decode_0", "decode_1"):
        wait_pool_free(server.metrics_url, m, timeout_s=30)
    before = migrations(server)
    # the guided stream first, alone: the decode instance with a request active serves it
    g = ConcurrentStreams(server.grpc_url, [GUIDED_PROMPT], 400, extra=guided, chat=True, perf_metrics=True)
    deadline = time.monotonic() + 60
    while g.received[0] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    serving = []
    while len(serving) != 1:  # the gauges refresh every few hundred ms
        assert time.monotonic() < deadline, "the guided stream shows on no decode instance"
        serving = [m for m in ("decode_0", "decode_1") if active(server, m)]
        time.sleep(0.05)
    victim = serving[0]
    prompts = PROMPTS[:8]
    streams = ConcurrentStreams(server.grpc_url, prompts, N_TOKENS, ignore_eos=True, perf_metrics=True)
    deadline = time.monotonic() + 120
    while min(streams.received) < 30 and g.received[0] < len(whole.token_ids) // 2:
        assert time.monotonic() < deadline, streams.received
        time.sleep(0.05)
    guided_before_kill = g.received[0]
    pid = kill_when(server, victim, lambda: True)
    results = streams.join()
    (r,) = g.join()
    assert [x.error for x in results] == [None] * 8 and r.error is None, ([x.error for x in results], r.error)
    for prompt, x in zip(prompts, results):
        want = hf_greedy(hf_model, prompt_token_ids(tokenizer, prompt, False), N_TOKENS)
        assert x.token_ids == want, prompt
        assert x.text == tokenizer.decode(want, skip_special_tokens=True), prompt
    # the guided stream moved mid-way (its grammar replayed the sent tokens) and equals the
    # uninterrupted run; its output is valid against the schema
    assert len(whole.token_ids) > guided_before_kill
    assert r.token_ids == whole.token_ids and r.text == whole.text
    document = json.loads(r.text)
    assert set(document) == {"name", "cities", "coastal"} and len(document["cities"]) == 12
    # each stream says whether it moved (its perf figures): the guided one did (it was on the
    # victim, mid-way), and so did at least one greedy stream; the front counted each move once
    assert r.perf is not None and r.perf["migrations"] == 1
    greedy_moved = sum(x.perf["migrations"] for x in results)
    assert greedy_moved >= 1 and all(x.perf["migrations"] <= 1 for x in results)
    counter = "triton_disagg_migrations_total"
    wait_metric(server.metrics_url, counter, before + 1 + greedy_moved, model="llm")
    assert settled_metric(server.metrics_url, counter, model="llm") - before == 1 + greedy_moved
    print(f"{1 + greedy_moved} of 9 streams moved off {victim} (the guided one included)")
    others = [m for m in MODELS if m != victim]
    for m in others:
        wait_pool_free(server.metrics_url, m, timeout_s=30)
    wait_serving(server, victim, pid)
    wait_pool_free(server.metrics_url, victim, timeout_s=30)


def test_a_killed_prefill_instance_is_recomputed_elsewhere(server, tokenizer, hf_model):
    prompts = [
        f"Case {k}. Summarise the ledger: " + " ".join(f"row {i} holds {i * (k + 3)} units;" for i in range(120))
        for k in range(4)
    ]
    before = sum(metric_values(server.metrics_url, "triton_disagg_kv_loads_recomputed_total"))
    streams = ConcurrentStreams(server.grpc_url, prompts, 8, ignore_eos=True)
    depth = "triton_disagg_prefill_queue_depth"
    pid = kill_when(server, "prefill_0", lambda: sum(metric_values(server.metrics_url, depth, model="prefill_0")) > 0)
    results = streams.join()
    assert [r.error for r in results] == [None] * 4
    for prompt, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(hf_model, prompt_token_ids(tokenizer, prompt, False), 8)
    time.sleep(0.6)
    recomputed = sum(metric_values(server.metrics_url, "triton_disagg_kv_loads_recomputed_total")) - before
    print(f"{recomputed:.0f} KV load(s) recomputed after prefill_0 was killed")
    assert recomputed >= 1
    wait_serving(server, "prefill_0", pid)
    for m in MODELS:
        wait_pool_free(server.metrics_url, m, timeout_s=30)


def test_streams_a_drain_ends_at_its_window_move(server, tokenizer, hf_model):
    """decode_1 drains (``triton-disagg drain``, signed, through etcd) with a 2 s window while it
    serves some of 6 streams of 400 tokens: it ends them as out of service at the window, and the
    front moves each (with the tokens its client has) to decode_0, where it completes: each
    stream's tokens equal an uninterrupted run's (the same prompts again, after, all on decode_0).
    400 tokens (about 20 s of decode here): the drain reaches decode_1 through etcd, which answered
    seconds late on a loaded CI machine, and at 160 tokens the streams had ended before it came."""
    from backend.launch.drain import drain, find, members

    assert server.etcd is not None
    etcd, secret = server.etcd.url, server.deployment_secret.encode()
    record = find([r for r in members(etcd, "default", secret) if r.role == "decode"], "decode_1")
    prompts = PROMPTS[:6]
    before = migrations(server)
    streams = ConcurrentStreams(server.grpc_url, prompts, DRAIN_TOKENS, ignore_eos=True)
    deadline = time.monotonic() + 120
    while min(streams.received) < 10 or not active(server, "decode_1"):
        assert time.monotonic() < deadline, streams.received
        time.sleep(0.05)
    on_victim = active(server, "decode_1")
    drain(etcd, record, secret)
    results = streams.join()
    assert [x.error for x in results] == [None] * len(prompts), [x.error for x in results]
    log = server.log_file.read_text(errors="replace")
    found = re.search(r"decode_1_0_0: drained \(.*\): (\d+) request\(s\) ended unfinished", log)
    assert found, "decode_1 did not log the end of its drain"
    ended = int(found.group(1))
    # the streams on decode_1 when the drain began that finished within its window did not move
    moved = wait_metric(server.metrics_url, "triton_disagg_migrations_total", before + ended, model="llm") - before
    print(
        f"{on_victim} of {len(prompts)} streams were on decode_1 when it drained; {ended} ended unfinished; "
        f"{moved:.0f} moved"
    )
    assert ended >= 1, "every stream on decode_1 finished within its 2 s window: none was ended"
    again = ConcurrentStreams(server.grpc_url, prompts, DRAIN_TOKENS, ignore_eos=True).join()
    assert [x.error for x in again] == [None] * len(prompts), [x.error for x in again]
    for prompt, x, y in zip(prompts, results, again):
        assert len(x.token_ids) == DRAIN_TOKENS and x.token_ids == y.token_ids, prompt
    # and the uninterrupted run is transformers' greedy output (its first N_TOKENS: computed once)
    for prompt, y in zip(prompts, again):
        assert y.token_ids[:N_TOKENS] == hf_greedy(hf_model, prompt_token_ids(tokenizer, prompt, False), N_TOKENS)
    for m in MODELS:  # the drained instance's pages too
        wait_pool_free(server.metrics_url, m, timeout_s=30)
