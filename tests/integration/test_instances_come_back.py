"""Instances that come back (issue 11, findings 3 and 4), on a real tritonserver: a killed
prefill or decode stub is detected, taken out of routing, reloaded through Triton's
model-control API by the supervisor, and serves again; requests streaming from a dead decode
instance move to the other one (request migration), new ones are routed around it; readiness
says "not ready" while a reload runs; a killed front model's requests are cancelled on the
decode instances (their pages freed) and the reloaded front serves."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests

from backend.client import stream_generate
from tests.conftest import deployment_server, metric_values, wait_pool_free

pytestmark = pytest.mark.usefixtures("nixl")

MODELS = ["prefill_0", "decode_0", "decode_1"]
LONG = "Tell me a long story about a dragon who learns to paint."


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with deployment_server(
        tmp_path_factory,
        "restart",
        timeout_s=400,
        mode="disagg",
        model_path=str(model_dir),
        prefill_instances=1,
        decode_instances=2,
        overrides={"kv_cache_tokens": "4096", "num_threads": "1", "kv_transfer_timeout_s": "15"},
        per_model={"front": {"health_probe_interval_s": "0.5"}},
    ) as s:
        yield s


def generate(server, prompt="What is the capital of France?", n=6):
    return stream_generate(server.grpc_url, prompt, n, model="llm", timeout_s=120, ignore_eos=True)


def kind(error: str | None) -> str | None:
    return error.split("]", 1)[0].lstrip("[") if error else None


def ready(server) -> int:
    return requests.get(f"http://{server.http_url}/v2/health/ready", timeout=5).status_code


def watch_readiness(server) -> tuple[list[int], threading.Event]:
    """The server's readiness statuses, polled every 0.25 s on a thread until the event is set."""
    watched, stop = [], threading.Event()

    def watch():
        while not stop.wait(0.25):
            watched.append(ready(server))

    threading.Thread(target=watch, daemon=True).start()
    return watched, stop


def wait_reloaded(server, model: str, old_pid: int, timeout_s: float = 180) -> list[int]:
    """Poll readiness until the supervisor has reloaded ``model``; returns the statuses seen."""
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen.append(ready(server))
        done = [r for r in server.supervisor.restarts if r.model == model and r.t_ready is not None]
        pid = server.instance_pids().get(f"{model}_0_0")
        if done and pid not in (None, old_pid) and seen[-1] == 200:
            return seen
        time.sleep(0.25)
    raise AssertionError(f"{model} not reloaded within {timeout_s}s: {server.supervisor.restarts}")


def serves_again(server, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if generate(server).error is None:
            return
        time.sleep(0.5)
    raise AssertionError(f"no request succeeded within {timeout_s}s of the reload")


def test_killed_prefill_instance_comes_back(server):
    assert generate(server).error is None
    old = server.instance_pids()["prefill_0_0_0"]
    os.kill(old, signal.SIGKILL)
    t_kill = time.monotonic()
    watched, stop_watch = watch_readiness(server)  # the reload may be over before the requests below end
    during = []
    for _ in range(3):  # while it is down: clear errors, fast, never a hang
        t0 = time.monotonic()
        r = generate(server)
        during.append((kind(r.error), round(time.monotonic() - t0, 1)))
    # a request whose prefill was under way is recomputed (None: it succeeded); later ones fail fast
    assert all(k in (None, "prefill_unavailable", "kv_transfer_failed", "out_of_service") for k, _ in during), during
    assert all(s < 20 for _, s in during), during
    seen = wait_reloaded(server, "prefill_0", old)
    stop_watch.set()
    seen = watched + seen
    assert any(s != 200 for s in seen), f"readiness stayed 200 through the reload: {seen}"
    serves_again(server)
    results = [generate(server) for _ in range(3)]
    assert all(r.error is None and r.token_ids for r in results), [r.error for r in results]
    print(f"prefill back {time.monotonic() - t_kill:.1f}s after the kill; during the outage: {during}")
    for m in MODELS:
        wait_pool_free(server.metrics_url, m, timeout_s=30)


def test_killed_decode_instance_moves_its_requests_and_comes_back(server):
    url = server.metrics_url
    results = {}

    streaming = [threading.Event(), threading.Event()]

    def run(i):
        results[i] = stream_generate(
            server.grpc_url,
            LONG,
            160,
            model="llm",
            timeout_s=120,
            ignore_eos=True,
            on_text=lambda t: streaming[i].set(),
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    # one stream on each decode model (fewest in flight first), both streaming
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        on_both = all(
            sum(metric_values(url, "triton_disagg_kv_pages_used", model=m)) > 0 for m in ("decode_0", "decode_1")
        )
        if on_both and all(e.is_set() for e in streaming):
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the two streams did not start on decode_0 and decode_1")
    old = server.instance_pids()["decode_0_0_0"]
    os.kill(old, signal.SIGKILL)
    t_kill = time.monotonic()
    # readiness watched from the kill on: the reload may be over before the streams below end
    watched, stop_watch = watch_readiness(server)
    during = [generate(server) for _ in range(4)]  # routed around the dead instance
    assert all(r.error is None and r.token_ids for r in during), [r.error for r in during]
    [t.join(120) for t in threads]
    # the stream on decode_0 moved to decode_1 with what it had sent (request migration) and
    # ended there; both streams have their whole output, the same (greedy, one prompt)
    assert [r.error for r in results.values()] == [None, None]
    assert results[0].token_ids == results[1].token_ids and len(results[0].token_ids) == 160
    assert sum(metric_values(url, "triton_disagg_migrations_total", model="llm")) >= 1
    seen = wait_reloaded(server, "decode_0", old)
    stop_watch.set()
    seen = watched + seen
    assert any(s != 200 for s in seen), f"readiness stayed 200 through the reload: {seen}"
    deadline = time.monotonic() + 30
    while metric_values(url, "triton_disagg_decode_target_up", model="llm", target="decode_0") != [1.0]:
        assert time.monotonic() < deadline, "the front did not route to decode_0 again"
        time.sleep(0.25)
    before = sum(metric_values(url, "triton_disagg_requests_total", model="decode_0"))
    back = [None] * 4
    pool = [threading.Thread(target=lambda i=i: back.__setitem__(i, generate(server))) for i in range(4)]
    [t.start() for t in pool]
    [t.join(120) for t in pool]
    assert all(r.error is None for r in back), [r.error for r in back]
    assert sum(metric_values(url, "triton_disagg_requests_total", model="decode_0")) > before
    print(f"decode back {time.monotonic() - t_kill:.1f}s after the kill")
    for m in MODELS:
        wait_pool_free(url, m, timeout_s=30)


def test_killed_front_model_frees_its_requests_and_comes_back(server):
    """kill -9 of the front model's stub while it relays 2 streams: the decode instances see
    their clients gone (the front reaches them over gRPC, its own server's too) and cancel the
    requests, freeing every page; the supervisor reloads the front and requests succeed again.
    (Its clients' own streams get nothing more: Triton does not end a dead stub's streams, so
    they end at the client's timeout, a short one here. Before, the decode instances answered a
    dead BLS caller: their sending thread blocked for good and they served nobody again.)"""
    url = server.metrics_url
    received = [0, 0]
    results: dict = {}

    def run(i):
        def on_text(_t, i=i):
            received[i] += 1

        results[i] = stream_generate(
            server.grpc_url, LONG, 400, model="llm", timeout_s=20, ignore_eos=True, on_text=on_text
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    deadline = time.monotonic() + 60
    while min(received) < 5:
        assert time.monotonic() < deadline, received
        time.sleep(0.05)
    old = server.instance_pids()["llm_0_0"]
    os.kill(old, signal.SIGKILL)
    t_kill = time.monotonic()
    for m in ("decode_0", "decode_1"):  # cancelled there long before 400 tokens
        wait_pool_free(url, m, timeout_s=30)
    freed_s = time.monotonic() - t_kill
    wait_reloaded(server, "llm", old)
    serves_again(server)
    results_after = [generate(server) for _ in range(3)]
    assert all(r.error is None and r.token_ids for r in results_after), [r.error for r in results_after]
    [t.join(60) for t in threads]
    assert all(len(r.token_ids) < 400 for r in results.values()), [len(r.token_ids) for r in results.values()]
    print(f"pages free {freed_s:.1f}s after the front's kill; it serves again {time.monotonic() - t_kill:.1f}s after")
    for m in MODELS:
        wait_pool_free(url, m, timeout_s=30)
