"""What a client sees when its decode instance dies, with request migration on and off.

python -m perf.bench_migration [--rounds 6] [--seconds 180] [--kill-every 60]

One server, 1 prefill + 2 decode instances behind the front model ``llm`` (cores split as in
``perf/lib/servers.py``). Two measurements, each side by side with migration on (``migration_limit``
3, the default) and off (0), on fresh servers in one run:

1. The gap: ``--rounds`` times, 4 greedy streams of 200 tokens start; once every stream has 40
   tokens, ``decode_0``'s stub is killed (SIGKILL). For each stream that was on it, the gap is
   the longest time between two tokens it received (the move: detection, re-routing, the KV of
   prompt plus output, the first new token); the same streams' median inter-token time is the
   baseline. With migration off those streams fail (counted). After each kill the supervisor
   reloads the stub before the next round.
2. Goodput under failures: 4 closed-loop clients send requests of 64 output tokens for
   ``--seconds``; ``decode_0`` is killed every ``--kill-every`` seconds. Goodput: requests
   finished without error per second (and their tokens per second); failures by kind.

JSON to ``migration.json`` in the results folder (``perf/results/``); the machine (CPU model,
cores) is recorded with it. Percentiles are ``backend/planner/stats.py``'s (linear interpolation).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

from backend.client import ConcurrentStreams, stream_generate
from backend.cluster.prometheus_text import metric_sum
from backend.planner.stats import gaps as gaps_of
from backend.planner.stats import median, percentile
from perf.lib import servers
from perf.lib.machine import cpu_model
from perf.lib.progress import bar
from perf.lib.results import results_dir

PROMPTS = [
    "Write a long story about a lighthouse keeper and the sea.",
    "Explain how a steam engine works, step by step, in detail.",
    "Describe the history of the printing press at length.",
    "List many facts about the planets of the solar system, one per line.",
]


def started(migration_limit: int, log_dir: Path):
    """The server for a ``with`` block: 1 prefill + 2 decode instances, migration as given."""
    return servers.started(
        "disagg",
        decode_instances=2,
        overrides={"kv_cache_tokens": "8192", "kv_quarantine_s": "3", "local_prefill_max_tokens": "0"},
        per_model={"front": {"migration_limit": str(migration_limit), "health_probe_interval_s": "0.5"}},
        log_dir=log_dir,
    )


def active(server, model: str) -> float:
    return metric_sum(server.metrics_url, "requests_active", model=model)


def kill_decode_0(server) -> int:
    pid = server.instance_pids()["decode_0_0_0"]
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_back(server, old_pid: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = server.instance_pids().get("decode_0_0_0")
        up = metric_sum(server.metrics_url, "decode_target_up", target="decode_0")
        if pid not in (None, old_pid) and up == 1.0:
            return
        time.sleep(0.5)
    raise RuntimeError("decode_0 was not reloaded in time")


def one_round(server, k: int) -> tuple[list, float, int, int]:
    """4 streams; kill decode_0 once each has 40 tokens. (results, kill time, streams on the
    victim, the victim's old pid)."""
    streams = ConcurrentStreams(server.grpc_url, [f"({k}) {p}" for p in PROMPTS], 200, ignore_eos=True)
    deadline = time.monotonic() + 120
    while min(streams.received) < 40 or active(server, "decode_0") == 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"round {k}: streams did not reach 40 tokens on decode_0")
        time.sleep(0.02)
    on_victim = int(active(server, "decode_0"))
    t_kill = time.perf_counter()
    pid = kill_decode_0(server)
    return streams.join(), t_kill, on_victim, pid


def gap_rounds(server, rounds: int) -> dict:
    gaps, baselines, failed, moved_streams, on_killed = [], [], 0, 0, 0
    for k in bar(range(rounds), "gap rounds"):
        results, t_kill, on_victim, pid = one_round(server, k)
        on_killed += on_victim
        for r in results:
            if r.error is not None:
                failed += 1
                continue
            if not r.times or r.times[-1] < t_kill:
                continue
            steps = gaps_of(r.times)
            longest = max(steps)
            # interrupted: a moved stream, or one on the other instance that paused while the moved
            # ones were prefilled again on the shared cores
            if longest > 5 * median(steps):
                moved_streams += 1
                gaps.append(longest)
                baselines.append(median(steps))
        print(
            f"round {k}: {on_victim} stream(s) on decode_0 when killed; errors {[r.error for r in results if r.error]}"
        )
        wait_back(server, pid)
    return {
        "rounds": rounds,
        "streams_on_killed_instance": on_killed,
        "streams_moved": moved_streams,  # interrupted (a pause > 5x the stream's median gap) and finished
        "streams_failed": failed,
        "gap_p50_s": percentile(gaps, 50),
        "gap_p99_s": percentile(gaps, 99),
        "gap_max_s": max(gaps) if gaps else float("nan"),
        "inter_token_median_s": median(baselines),
    }


def goodput(server, seconds: float, kill_every: float) -> dict:
    results: list = []
    stop = threading.Event()
    lock = threading.Lock()

    def client(c: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            r = stream_generate(
                server.grpc_url, f"Client {c}, request {n}: describe a city.", 64, ignore_eos=True, timeout_s=300
            )
            with lock:
                results.append(r)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
    t0 = time.monotonic()
    [t.start() for t in threads]
    kills = 0
    next_kill = t0 + kill_every
    while time.monotonic() - t0 < seconds:
        if time.monotonic() >= next_kill:
            try:
                kill_decode_0(server)
                kills += 1
            except KeyError:  # still reloading from the last kill
                pass
            next_kill += kill_every
        time.sleep(0.2)
    stop.set()
    [t.join(300) for t in threads]
    elapsed = time.monotonic() - t0
    ok = [r for r in results if r.error is None]
    kinds: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            kind = r.error.split("]", 1)[0].lstrip("[") if r.error.startswith("[") else "other"
            kinds[kind] = kinds.get(kind, 0) + 1
    return {
        "seconds": round(elapsed, 1),
        "kills": kills,
        "requests": len(results),
        "ok": len(ok),
        "failed_by_kind": kinds,
        "goodput_req_s": len(ok) / elapsed,
        "goodput_tokens_s": sum(len(r.token_ids) for r in ok) / elapsed,
    }


def _failed(goodput_result: dict) -> str:
    kinds = goodput_result.get("failed_by_kind") or {}
    return ", ".join(f"{n} {k}" for k, n in kinds.items()) or "none failed"


def table(out: dict) -> str:
    """Migration on against off as markdown: streams on the killed instance, what became of the
    streams after the kill (failed; paused and finished, which with migration on includes every
    moved stream), the pause, goodput under kills."""
    on, off = out["migration_on"], out["migration_off"]
    a = out["args"]

    def victims(g: dict) -> str:
        return str(g.get("streams_on_killed_instance", "?"))

    def streams(g: dict) -> str:
        return f"{g['streams_failed']} failed; {g['streams_moved']} paused and finished"

    def gap(g: dict) -> str:
        if not g["streams_moved"]:
            return "-"
        return f"{g['gap_p50_s']:.2f} s / {g['gap_p99_s']:.2f} s / {g['gap_max_s']:.2f} s"

    def put(r: dict) -> str:
        return (
            f"{r['goodput_req_s']:.3f} req/s ({r['ok']}/{r['requests']} ok; {_failed(r)}), "
            f"{r['goodput_tokens_s']:.1f} tokens/s"
        )

    ratio = on["goodput"]["goodput_req_s"] / max(off["goodput"]["goodput_req_s"], 1e-9)

    def median_gap(g: dict) -> str:
        m = g["inter_token_median_s"]
        return "-" if math.isnan(m) else f"{1000 * m:.0f} ms"

    rows = [
        f"Migration on (migration_limit 3) against off (0), each on a fresh server; {a['rounds']} kill rounds, "
        f"then {a['seconds']:g} s of closed-loop load with decode_0 killed every {a['kill_every']:g} s:",
        "",
        "| | migration on | migration off |",
        "|---|---|---|",
        f"| streams on the killed instance ({a['rounds']} rounds) | {victims(on['gap'])} | {victims(off['gap'])} |",
        f"| after the kill: streams failed; streams that paused (> 5x their median gap) and finished | "
        f"{streams(on['gap'])} | {streams(off['gap'])} |",
        f"| the longest pause in those streams: p50 / p99 / max | {gap(on['gap'])} | {gap(off['gap'])} |",
        f"| median inter-token time of the same streams | {median_gap(on['gap'])} | {median_gap(off['gap'])} |",
        f"| goodput, {on['goodput']['kills']} / {off['goodput']['kills']} kills | {put(on['goodput'])} | "
        f"{put(off['goodput'])} |",
        f"| goodput ratio | {ratio:.2f}x | 1x |",
    ]
    return "\n".join(rows) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=180)
    p.add_argument("--kill-every", type=float, default=60)
    p.add_argument("--log-dir", default="/tmp/triton-disagg-bench-migration")
    args = p.parse_args(argv)
    out: dict = {"machine": {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0))}, "args": vars(args)}
    for label, limit in (("migration_on", 3), ("migration_off", 0)):
        with started(limit, Path(args.log_dir) / label) as server:
            print(f"== {label}: gap rounds", flush=True)
            out[label] = {"gap": gap_rounds(server, args.rounds)}
            print(f"== {label}: goodput with decode_0 killed every {args.kill_every:g}s", flush=True)
            out[label]["goodput"] = goodput(server, args.seconds, args.kill_every)
        print(json.dumps(out[label], indent=1), flush=True)
    (results_dir() / "migration.json").write_text(json.dumps(out, indent=1))
    print(table(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
