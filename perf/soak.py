"""Soak: minutes of mixed traffic with client cancels and bad requests against a deployment;
afterwards every KV page is free, no request is active, and the server's memory grew little.

python -m perf.soak --mode disagg --minutes 3 --concurrency 6 --cancel-share 0.22

Each worker loops: a prompt of 8-600 tokens, 8-64 output tokens, sampled or greedy; a share of
requests is cancelled by the client after a random number of responses, another share is a
bad request (NaN temperature, out-of-range end_id, an oversized stop-word list). At the end it
waits for the pools to drain and reports requests by outcome, the pages and requests still held
per model (must be 0), and the resident memory of every stub process before and after. The
JSON goes to ``soak_<mode>.json`` in the results folder (``perf/results/``).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter

import psutil

from backend.client import stream_generate
from backend.cluster.prometheus_text import metric_values, read_metrics
from perf.lib import servers
from perf.lib.results import results_dir


def stub_rss(server) -> dict[str, float]:
    out = {}
    for name, pid in server.instance_pids().items():
        try:
            out[name] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.Error:
            pass
    return out


def held(server) -> dict[str, dict[str, float]]:
    metrics = read_metrics(server.metrics_url)
    names = ("triton_disagg_kv_pages_used", "triton_disagg_requests_active")  # the front has no pool
    models = sorted({dict(labels)["model"] for (name, labels) in metrics if name in names})
    return {
        m: {
            "kv_pages_used": sum(metric_values(server.metrics_url, "triton_disagg_kv_pages_used", model=m)),
            "requests_active": sum(metric_values(server.metrics_url, "triton_disagg_requests_active", model=m)),
        }
        for m in models
    }


def worker(server, seconds: float, cancel_share: float, bad_share: float, seed: int, counts: Counter, lock) -> None:
    rng = random.Random(seed)
    words = "the quick brown fox jumps over the lazy dog while a river runs to the sea".split()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(8, 450)))
        n = rng.randint(8, 64)
        kw = {"temperature": rng.choice([None, 0.7]), "seed": rng.randint(0, 2**31)}
        r = rng.random()
        if r < bad_share:
            kind = rng.choice(["nan", "end_id", "stops"])
            if kind == "nan":
                kw["temperature"] = float("nan")
            elif kind == "end_id":
                kw["end_id"] = 10**9
            else:
                kw["stop_words"] = ["x"] * 100
            outcome = "bad"
        elif r < bad_share + cancel_share:
            kw["cancel_after"] = rng.randint(1, 8)
            outcome = "cancel"
        else:
            outcome = "full"
        res = stream_generate(server.grpc_url, prompt, n, timeout_s=300, **kw)
        if outcome == "full":
            outcome = "ok" if res.error is None else "failed"
        elif outcome == "bad":
            outcome = "refused" if res.error and "[bad_request]" in res.error else "bad-not-refused"
        else:
            outcome = "cancelled"
        with lock:
            counts[outcome] += 1
            if outcome in ("failed", "bad-not-refused"):
                counts[f"error: {(res.error or '')[:80]}"] += 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["aggregated", "disagg"], default="disagg")
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--cancel-share", type=float, default=0.22)
    p.add_argument("--bad-share", type=float, default=0.05)
    args = p.parse_args(argv)
    with servers.started(args.mode, overrides={"kv_cache_tokens": "8192"}) as server:
        stream_generate(server.grpc_url, "warm up", 4)
        rss_before = stub_rss(server)
        counts, lock = Counter(), threading.Lock()
        threads = [
            threading.Thread(
                target=worker,
                args=(server, args.minutes * 60, args.cancel_share, args.bad_share, i, counts, lock),
                daemon=True,
            )
            for i in range(args.concurrency)
        ]
        t0 = time.monotonic()
        [t.start() for t in threads]
        [t.join() for t in threads]
        elapsed = time.monotonic() - t0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            still = held(server)
            if all(v["kv_pages_used"] == 0 and v["requests_active"] == 0 for v in still.values()):
                break
            time.sleep(0.5)
        rss_after = stub_rss(server)
    growth = {k: round(rss_after.get(k, 0) - v, 1) for k, v in rss_before.items()}
    report = {
        "mode": args.mode,
        "seconds": round(elapsed, 1),
        "concurrency": args.concurrency,
        "outcomes": dict(counts),
        "held_after": still,
        "rss_mib_before": {k: round(v, 1) for k, v in rss_before.items()},
        "rss_growth_mib": growth,
    }
    (results_dir() / f"soak_{args.mode}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    leaked = any(v["kv_pages_used"] or v["requests_active"] for v in still.values())
    bad = counts.get("failed", 0) + counts.get("bad-not-refused", 0)
    return 1 if leaked or bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
