"""Tensor-parallel instances on a real tritonserver, KV sharded across the fabric end to end.

One server holds both directions: prefill_0 (TP 1) -> decode_0 (TP 3) and prefill_1 (TP 3)
-> decode_1 (TP 1), each decode model pinned to its prefill endpoint, plus llm_aggregated
(TP 1). Greedy outputs of both pairs equal the aggregated model and transformers; the write
counters follow the transfer plan; killing one rank process takes its instance out with
clear errors while the other instances keep serving, and the instance asks its server's
supervisor to load it again: it serves again, with fresh ranks, without a server restart.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import psutil
import pytest

from backend.client import stream_generate
from tests.conftest import (
    EXACT,
    PROMPTS,
    generate_concurrently,
    hf_greedy,
    metric_values,
    running_server,
    wait_pool_free,
)

N_TOKENS = 8
CASES = PROMPTS[:6] + [PROMPTS[6]]  # the last: ~200 tokens, 4 prefill chunks at a 64-token budget
MODELS = ["prefill_0", "prefill_1", "decode_0", "decode_1", "llm_aggregated"]


@pytest.fixture(scope="module")
def tp_server(model_dir, tmp_path_factory):
    from backend.launch.deployment import render_deployment
    from backend.launch.ports import free_port

    tmp = tmp_path_factory.mktemp("tp")
    p0, p1 = free_port(), free_port()
    repo = render_deployment(
        tmp / "repo",
        mode="disagg",
        model_path=str(model_dir),
        prefill_instances=2,
        decode_instances=2,
        with_aggregated=True,
        overrides={
            "kv_cache_tokens": "2048",
            "max_num_batched_tokens": "64",
            "max_tokens_limit": "64",
            "num_threads": "1",
            "kv_transfer_timeout_s": "60",
            "kv_quarantine_s": "4",
            "kv_xfer_timeout_s": "10",
            "local_prefill_max_tokens": "0",  # every prefill crosses the fabric (TP 1 <-> 3)
            **EXACT,
        },
        per_model={
            "prefill_0": {"messenger_port": p0},
            "prefill_1": {"messenger_port": p1, "tensor_parallel_size": "3"},
            "decode_0": {"prefill_endpoints": f"127.0.0.1:{p0}", "tensor_parallel_size": "3"},
            "decode_1": {"prefill_endpoints": f"127.0.0.1:{p1}"},
        },
    )
    with running_server(repo, tmp / "tritonserver.log", timeout_s=400) as server:
        yield server


def generate_all(url, prompts, model, n_tokens=N_TOKENS, **kw):
    return generate_concurrently(url, prompts, model, n_tokens, **kw)


def writes(url, model):
    return sum(metric_values(url, "triton_disagg_kv_writes_total", model=model))


def rank_pids(server, instance):
    stub = psutil.Process(server.instance_pids()[instance])
    return [c.pid for c in stub.children(recursive=True) if "backend.parallel.rank" in " ".join(c.cmdline())]


def test_sharded_transfers_match_aggregated_and_transformers(tp_server, hf_model, tokenizer):

    from fabric_bridge.layout import KVLayout
    from fabric_bridge.plan import expected_writes

    url, murl = tp_server.grpc_url, tp_server.metrics_url
    assert len(rank_pids(tp_server, "prefill_1_0_0")) == 2 and len(rank_pids(tp_server, "decode_0_0_0")) == 2
    before = {m: writes(murl, m) for m in MODELS[:4]}
    results = {m: generate_all(url, CASES, m) for m in ("decode_0", "decode_1", "llm_aggregated")}
    for m, res in results.items():
        assert all(r.error is None for r in res), (m, [r.error for r in res])
    assert [r.token_ids for r in results["decode_0"]] == [r.token_ids for r in results["llm_aggregated"]]
    assert [r.token_ids for r in results["decode_1"]] == [r.token_ids for r in results["llm_aggregated"]]

    lengths = [len(tokenizer.encode(p, add_special_tokens=False)) for p in CASES]
    for prompt, res in zip(CASES, results["llm_aggregated"]):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert res.token_ids == hf_greedy(hf_model, ids, N_TOKENS), prompt[:40]
    assert lengths[-1] - 1 > 3 * 64, lengths

    # HND, TP 1 <-> TP 3: one write per page per layer per destination (K and V: 2) head slice
    tp1, tp3 = (KVLayout("SmolLM2-135M-Instruct", 30, 16, 3, 64, "float32", tp_size=t) for t in (1, 3))
    pages = sum(math.ceil((n - 1) / 16) for n in lengths)
    want = {"decode_0": expected_writes(tp1, tp3, pages), "decode_1": expected_writes(tp3, tp1, pages)}
    assert want["decode_0"] == want["decode_1"] == pages * 30 * 6
    time.sleep(0.6)  # metrics refresh period
    got = {m: writes(murl, m) - before[m] for m in MODELS[:4]}
    assert got == {
        "decode_0": want["decode_0"],
        "prefill_0": want["decode_0"],
        "decode_1": want["decode_1"],
        "prefill_1": want["decode_1"],
    }, (got, want)
    for m in MODELS:
        wait_pool_free(murl, m, timeout_s=30)


def test_killed_rank_takes_its_instance_out_until_it_is_loaded_again(tp_server):
    """Runs last: kill a rank of prefill_1 (TP 3) mid-prefill, then one of decode_0 (TP 3); each
    is out of service at once, then loaded again by the supervisor, and serves again."""
    url, murl = tp_server.grpc_url, tp_server.metrics_url
    long_prompt = "Describe this list. " + " ".join(f"entry {i}" for i in range(300))
    box = {}
    t = threading.Thread(
        target=lambda: box.update(r=stream_generate(url, long_prompt, 4, model="decode_1", timeout_s=120))
    )
    t.start()
    deadline = time.monotonic() + 30
    while not any(v > 0 for v in metric_values(murl, "triton_disagg_prefill_queue_depth", model="prefill_1")):
        assert time.monotonic() < deadline, "prefill_1 never picked up the request"
        time.sleep(0.1)
    t_kill = time.monotonic()
    os.kill(rank_pids(tp_server, "prefill_1_0_0")[0], signal.SIGKILL)
    t.join(120)
    r = box["r"]
    # the decode instance is healthy: for it the prefill's failure is a failed KV load, which it
    # computes again itself (kv_load_failure_policy=recompute, the default; no other prefill
    # instance serves it) once no late write can land in its pages (kv_quarantine_s)
    assert r.error is None and len(r.token_ids) == 4, r.error
    assert time.monotonic() - t_kill < 30
    deadline = time.monotonic() + 5  # the metrics refresh period
    while sum(metric_values(murl, "triton_disagg_kv_loads_recomputed_total", model="decode_1")) < 1:
        assert time.monotonic() < deadline, "decode_1 did not count the recomputed load"
        time.sleep(0.2)
    # prefill_1 stopped listening: once decode_1 saw its connection drop (a moment), it answers
    # at once that no prefill instance is reachable
    time.sleep(1.0)
    again = stream_generate(url, PROMPTS[0], 4, model="decode_1", timeout_s=60)
    assert again.error and again.error.startswith("[prefill_unavailable] no prefill instance reachable"), again.error
    wait_pool_free(murl, "decode_1", timeout_s=30)
    # the other instances keep serving
    ok = generate_all(url, PROMPTS[:2], "decode_0", n_tokens=4) + generate_all(
        url, PROMPTS[:2], "llm_aggregated", n_tokens=4
    )
    assert all(x.error is None and len(x.token_ids) == 4 for x in ok), [x.error for x in ok]

    os.kill(rank_pids(tp_server, "decode_0_0_0")[1], signal.SIGKILL)
    time.sleep(1.0)  # the lead's watcher notices within 0.2 s
    t0 = time.monotonic()
    down = stream_generate(url, PROMPTS[1], 4, model="decode_0", timeout_s=60)
    # an error at once: out of service, or (its reload begun) Triton's for a model being loaded
    out = down.error.startswith("[out_of_service]") and "signal 9" in down.error
    assert down.error and (out or "'decode_0'" in down.error), down.error
    assert time.monotonic() - t0 < 10
    agg = stream_generate(url, PROMPTS[1], 4, model="llm_aggregated", ignore_eos=True)
    assert agg.error is None and len(agg.token_ids) == 4, agg.error
    # each instance that lost a rank asked the supervisor to load it again: both serve again,
    # decode_1 through prefill_1 (its messenger reconnects), their tokens the aggregated model's
    want = stream_generate(url, PROMPTS[2], 4, model="llm_aggregated", ignore_eos=True)
    for model in ("decode_0", "decode_1"):
        deadline = time.monotonic() + 240
        while (back := stream_generate(url, PROMPTS[2], 4, model=model, ignore_eos=True, timeout_s=60)).error:
            assert time.monotonic() < deadline, f"{model} did not serve again: {back.error}"
            time.sleep(1.0)
        assert back.token_ids == want.token_ids, model
        print(f"{model} serves again {time.monotonic() - t_kill:.0f} s after prefill_1's rank was killed")
    for m in ("prefill_1", "decode_0"):  # each asked with its reason, and its last reload served
        restarts = [r for r in tp_server.supervisor.restarts if r.model == m]
        assert any("out of service" in r.reason and "signal 9" in r.reason for r in restarts), restarts
        assert restarts[-1].error is None and restarts[-1].t_ready is not None, restarts
    for m in MODELS:
        wait_pool_free(murl, m, timeout_s=30)
