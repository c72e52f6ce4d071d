"""The comparison this project exists for: the same load against (a) aggregated serving with
the whole machine and (b) disaggregated 1 prefill + 1 decode with the machine split between
them, started and stopped by this harness, side by side in one run.

Reports per-stream decode tokens/s (p50), inter-token latency p50/p99/max, TTFT p50/p99,
requests/s completed and the ratios (b)/(a); plots inter-token latency over time for a few
streams per mode and the CDF of inter-token latency; writes a markdown report with the
figures, the plots, the machine and the command, into the results folder (``perf/results/``).

    python -m perf.compare_modes [--rate 0.1] [--duration 120] [--low-rate 0.03]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import numpy as np

from backend.launch.deployment import core_split
from backend.planner.stats import percentile
from perf.lib import loadgen, results, servers
from perf.lib.results import results_dir

MODES = ("aggregated", "disagg")
TARGETS = {"decode_tps_p50": (">=", 1.8), "itl_p99": ("<=", 0.3), "ttft_p50_low_load": ("<=", 1.3)}


def summarize(records, wall_s: float) -> dict:
    ok = [r for r in records if r.error is None and r.n_tokens == r.max_tokens]
    gaps = [g for r in ok for g in r.gaps]
    ttft = [r.ttft for r in ok]
    tps = [r.decode_tokens_per_s for r in ok if not math.isnan(r.decode_tokens_per_s)]
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": [r.error for r in records if r.error][:5],
        "decode_tps_p50": percentile(tps, 50),
        "itl_p50": percentile(gaps, 50),
        "itl_p99": percentile(gaps, 99),
        "itl_max": max(gaps) if gaps else float("nan"),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "req_per_s": len(ok) / wall_s if wall_s > 0 else float("nan"),
        "wall_s": wall_s,
    }


def plot(runs: dict, out_dir: Path, stamp: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.2 * len(runs)), sharex=True, sharey=True)
    for ax, (mode, recs) in zip(np.atleast_1d(axes), runs.items()):
        t0 = min(r.t_submit for r in recs) if recs else 0
        busiest = sorted([r for r in recs if len(r.token_times) > 2], key=lambda r: -max(r.gaps))[:4]
        for r in sorted(busiest, key=lambda r: r.index):
            ax.plot([t - t0 for t in r.token_times[1:]], [g * 1e3 for g in r.gaps], lw=0.9, label=f"request {r.index}")
        ax.set_title(f"{mode}: inter-token latency of the 4 streams with the largest stall")
        ax.set_ylabel("ITL (ms)")
        ax.legend(fontsize=7, loc="upper right")
    np.atleast_1d(axes)[-1].set_xlabel("time since first request (s)")
    fig.tight_layout()
    paths.append(out_dir / f"itl_over_time_{stamp}.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, recs in runs.items():
        gaps = np.sort([g * 1e3 for r in recs if r.error is None for g in r.gaps])
        if len(gaps):
            ax.plot(gaps, np.arange(1, len(gaps) + 1) / len(gaps), label=mode)
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms, log)")
    ax.set_ylabel("fraction of tokens")
    ax.set_title("CDF of inter-token latency")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / f"itl_cdf_{stamp}.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def ratio(b: float, a: float) -> float:
    return b / a if a and not math.isnan(a) and not math.isnan(b) else float("nan")


def report(stats: dict, low: dict, plots: list[Path], w: loadgen.Workload, args, out: Path) -> str:
    a, b = stats["aggregated"], stats["disagg"]
    pre, dec, n_pre, n_dec = core_split()
    rows = [
        ("per-stream decode tokens/s, p50", "decode_tps_p50", "{:.1f}"),
        ("inter-token latency p50 (ms)", "itl_p50", "{:.1f}"),
        ("inter-token latency p99 (ms)", "itl_p99", "{:.1f}"),
        ("inter-token latency max (ms)", "itl_max", "{:.1f}"),
        ("TTFT p50 (s)", "ttft_p50", "{:.2f}"),
        ("TTFT p99 (s)", "ttft_p99", "{:.2f}"),
        ("requests/s completed", "req_per_s", "{:.3f}"),
    ]
    ms = {"itl_p50", "itl_p99", "itl_max"}
    lines = [
        f"# Aggregated vs disaggregated serving under load ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"Machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} cores "
        f"({len(os.sched_getaffinity(0))} usable), Python {platform.python_version()}. "
        f"Model: SmolLM2-135M-Instruct fp32 on CPU.",
        "",
        f"(a) aggregated `llm`, all cores ({len(os.sched_getaffinity(0))} torch threads); "
        f"(b) disaggregated 1 prefill (cores {pre}, {n_pre} threads) + 1 decode (cores {dec}, "
        f"{n_dec} threads), KV over NIXL/UCX between the two processes.",
        "",
        f"Workload: Poisson arrivals at {w.rate} req/s for {w.duration_s:.0f}s, prompts "
        f"{w.prompt_tokens[0]}-{w.prompt_tokens[1]} tokens, outputs {w.output_tokens[0]}-{w.output_tokens[1]} "
        f"tokens (ignore_eos), seed {w.seed}; per-step token budget {args.token_budget}.",
        "",
        "| metric | (a) aggregated | (b) disaggregated | (b)/(a) |",
        "|---|---|---|---|",
    ]
    for label, key, fmt in rows:
        va, vb = a[key], b[key]
        scale = 1e3 if key in ms else 1
        lines.append(f"| {label} | {fmt.format(va * scale)} | {fmt.format(vb * scale)} | {ratio(vb, va):.2f} |")
    lines += ["", f"Completed: (a) {a['completed']}/{a['requests']}, (b) {b['completed']}/{b['requests']}."]
    if low:
        la, lb = low["aggregated"], low["disagg"]
        lines += [
            "",
            f"Low load ({args.low_rate} req/s, {args.low_duration:.0f}s): TTFT p50 (a) {la['ttft_p50']:.2f}s, "
            f"(b) {lb['ttft_p50']:.2f}s, ratio {ratio(lb['ttft_p50'], la['ttft_p50']):.2f}.",
        ]
    checks = {
        "decode_tps_p50": ratio(b["decode_tps_p50"], a["decode_tps_p50"]),
        "itl_p99": ratio(b["itl_p99"], a["itl_p99"]),
        "ttft_p50_low_load": ratio(low["disagg"]["ttft_p50"], low["aggregated"]["ttft_p50"]) if low else float("nan"),
    }
    lines += ["", "| target | measured | goal | met |", "|---|---|---|---|"]
    for k, (op, goal) in TARGETS.items():
        v = checks[k]
        met = (v >= goal) if op == ">=" else (v <= goal)
        lines.append(f"| {k} (b)/(a) | {v:.2f} | {op} {goal} | {'yes' if met else 'no'} |")
    lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    lines += ["", "Reproduce:", "", "```", results.command_line("perf.compare_modes"), "```"]
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    return text


def run_mode(mode: str, tokenizer, w: loadgen.Workload, args, desc: str) -> tuple[list, float]:
    with servers.started(
        mode,
        overrides={
            "kv_cache_tokens": "16384",
            "max_num_batched_tokens": str(args.token_budget),
            "max_tokens_limit": "256",
            "max_num_seqs": "32",
            "weights_dtype": args.weights_dtype,
        },
    ) as server:
        loadgen.warm_up(server.grpc_url, tokenizer)
        return loadgen.run(server.grpc_url, tokenizer, w, desc=desc)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=0.1, help="requests/s for the main comparison")
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--low-rate", type=float, default=0.03, help="requests/s for the low-load TTFT check (0: skip)")
    p.add_argument("--low-duration", type=float, default=90.0)
    loadgen.add_workload_args(p, prompt_tokens=(512, 1024), output_tokens=(64, 128))
    p.add_argument("--token-budget", type=int, default=256, help="per-step token budget (chunked prefill)")
    p.add_argument(
        "--weights-dtype",
        default="auto",
        help="weights_dtype of every instance (auto: serve's default; float32, fp16w, int4w)",
    )
    args = p.parse_args(argv)
    tok = loadgen.load_tokenizer()
    stamp = time.strftime("%Y%m%d_%H%M%S")
    out_dir = results_dir()
    w = loadgen.Workload(
        rate=args.rate,
        duration_s=args.duration,
        prompt_tokens=tuple(args.prompt_tokens),
        output_tokens=tuple(args.output_tokens),
        seed=args.seed,
    )
    runs, stats, low = {}, {}, {}
    for mode in MODES:
        recs, wall = run_mode(mode, tok, w, args, mode)
        runs[mode], stats[mode] = recs, summarize(recs, wall)
        print(mode, json.dumps(stats[mode]), flush=True)
        if args.low_rate > 0:
            lw = loadgen.Workload(
                rate=args.low_rate,
                duration_s=args.low_duration,
                prompt_tokens=w.prompt_tokens,
                output_tokens=w.output_tokens,
                seed=args.seed + 1,
            )
            lrecs, lwall = run_mode(mode, tok, lw, args, f"{mode}, low load")
            low[mode] = summarize(lrecs, lwall)
            print(mode, "low load", json.dumps(low[mode]), flush=True)
    plots = plot(runs, out_dir, stamp)
    text = report(stats, low, plots, w, args, out_dir / f"report_{stamp}.md")
    (out_dir / f"compare_{stamp}.json").write_text(
        json.dumps(
            {"stats": stats, "low_load": low, "records": {m: loadgen.records_to_json(r) for m, r in runs.items()}}
        )
    )
    print(text)
    print(f"report: {out_dir / f'report_{stamp}.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
