"""Goodput under SLOs: aggregated serving with its per-step token budget swept (the best-tuned
aggregated baseline) against disaggregated 1 prefill + 1 decode, on this machine.

For each deployment: start it, measure one request at a time (the median prompt and output) for
the unloaded TTFT and inter-token latency, then replay Poisson streams of ``--requests``
requests at rising rates. A request attains an SLO when it completes with TTFT <= T and the p90
of its inter-token gaps <= I. The SLOs come from the unloaded figures of the fastest aggregated
deployment: T = ``--ttft-factor`` x its TTFT, tight I = ``--tight-itl-factor`` x its ITL, loose I
= ``--loose-itl-factor`` x its ITL (or give them in seconds). Goodput = the highest swept rate
such that every rate up to it has >= 90% attainment. A deployment's sweep stops after a rate
where fewer than half its requests attain the loose SLO.

Writes, into the results folder (``perf/results/``), ``goodput_<stamp>.json`` (every request,
the SLOs, the goodput), a trace per measured point (``trace_<deployment>_<rate>.jsonl``, for
``triton-disagg plan --trace``), the attainment-vs-rate plot and a markdown report.

    python -m perf.goodput [--deployments agg64,agg128,agg256,agg512,disagg] [--rates 0.1,0.2,0.3,0.45,0.65]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from backend.cluster.prometheus_text import metric_sum
from backend.planner.slo import ATTAINMENT_GOAL, SLO, measured_goodput
from backend.planner.stats import median
from backend.planner.workload import TraceRequest, save_trace
from perf.lib import loadgen, servers
from perf.lib.results import command_line, results_dir


def deployment(name: str) -> tuple[str, int]:
    """``aggN`` -> (aggregated, budget N); ``disagg`` -> (disagg, 512)."""
    if name == "disagg":
        return "disagg", 512
    if name.startswith("agg") and name[3:].isdigit():
        return "aggregated", int(name[3:])
    raise SystemExit(f"unknown deployment {name!r}: aggN (N = per-step token budget) or disagg")


def attainment(recs: list[dict], ttft_slo: float, itl_slo: float) -> float:
    """The share of measured requests (``as_dict``) that attain the SLO (``backend/planner/slo.py``)."""
    slo = SLO(ttft_slo, itl_slo)
    met = [slo.attained(r["error"] is None and r["n_tokens"] == r["max_tokens"], r["ttft"], r["gaps"]) for r in recs]
    return sum(met) / len(met) if met else float("nan")


def as_dict(rec: loadgen.RequestRecord) -> dict:
    return {
        "offset": rec.offset,
        "prompt_tokens": rec.prompt_tokens,
        "max_tokens": rec.max_tokens,
        "ttft": rec.ttft,
        "gaps": rec.gaps,
        "n_tokens": rec.n_tokens,
        "error": rec.error,
    }


def wait_idle(server, timeout_s: float = 120.0) -> None:
    """Until no request is active in any instance (the previous point's stragglers are done)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(2.0)
        if metric_sum(server.metrics_url, "requests_active") == 0:
            return
    print("warning: requests still active after the drain; starting the next point anyway", flush=True)


def unloaded(server, tok, args) -> dict:
    n_in = (args.prompt_tokens[0] + args.prompt_tokens[1]) // 2
    n_out = (args.output_tokens[0] + args.output_tokens[1]) // 2
    recs = []
    for i in range(args.unloaded_requests):
        w = loadgen.Workload(
            rate=100.0, n_requests=1, prompt_tokens=(n_in, n_in), output_tokens=(n_out, n_out), seed=1000 + i
        )
        recs += loadgen.run(server.grpc_url, tok, w, desc=None)[0]
    ok = [r for r in recs if r.error is None]
    if not ok:
        raise SystemExit(f"unloaded requests failed: {[r.error for r in recs]}")
    return {
        "ttft": median(r.ttft for r in ok),
        "itl": median(g for r in ok for g in r.gaps),
        "prompt_tokens": n_in,
        "output_tokens": n_out,
    }


def slos(unloaded_by: dict, args) -> dict:
    aggs = [v for k, v in unloaded_by.items() if deployment(k)[0] == "aggregated"] or list(unloaded_by.values())
    ttft0, itl0 = min(u["ttft"] for u in aggs), min(u["itl"] for u in aggs)
    return {
        "ttft": args.ttft_slo or args.ttft_factor * ttft0,
        "tight_itl": args.tight_itl_slo or args.tight_itl_factor * itl0,
        "loose_itl": args.loose_itl_slo or args.loose_itl_factor * itl0,
        "base_ttft": ttft0,
        "base_itl": itl0,
    }


def sweep(name: str, tok, args, unloaded_by: dict, out: dict) -> None:
    mode, budget = deployment(name)
    overrides = {
        "kv_cache_tokens": "16384",
        "max_num_batched_tokens": str(budget),
        "max_tokens_limit": "256",
        "max_num_seqs": "32",
        "weights_dtype": args.weights_dtype,
    }
    with servers.started(mode, overrides=overrides) as server:
        loadgen.warm_up(server.grpc_url, tok)
        unloaded_by[name] = unloaded(server, tok, args)
        print(name, "unloaded", json.dumps(unloaded_by[name]), flush=True)
        s = slos(unloaded_by, args)
        out[name] = {"mode": mode, "budget": budget, "unloaded": unloaded_by[name], "points": {}}
        for k, rate in enumerate(args.rates):
            w = loadgen.Workload(
                rate=rate,
                n_requests=args.requests,
                prompt_tokens=tuple(args.prompt_tokens),
                output_tokens=tuple(args.output_tokens),
                seed=args.seed + k,
                drain_timeout_s=args.drain,
            )
            t0 = time.perf_counter()
            desc = f"{name} rate {rate} ({k + 1}/{len(args.rates)})"
            recs, wall = loadgen.run(server.grpc_url, tok, w, desc=desc)
            recs = [as_dict(r) for r in recs]
            out[name]["points"][str(rate)] = {"wall_s": wall, "records": recs}
            save_trace(
                results_dir() / f"trace_{args.stamp}_{name}_{rate}.jsonl",
                [TraceRequest(r["offset"], r["prompt_tokens"], r["max_tokens"]) for r in recs],
            )
            loose = attainment(recs, s["ttft"], s["loose_itl"])
            tight = attainment(recs, s["ttft"], s["tight_itl"])
            print(
                f"{name} rate {rate}: attainment tight {tight:.2f} loose {loose:.2f} ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
            wait_idle(server)
            if loose < 0.5:
                break


def plot(results: dict, s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key, label in ((axes[0], "tight_itl", "tight"), (axes[1], "loose_itl", "loose")):
        for name, res in results.items():
            rates = sorted(float(r) for r in res["points"])
            att = [attainment(res["points"][str(r)]["records"], s["ttft"], s[key]) for r in rates]
            ax.plot(rates, [a * 100 for a in att], marker="o", label=name)
        ax.axhline(ATTAINMENT_GOAL * 100, color="grey", ls="--", lw=0.8)
        ax.set_title(f"{label} SLO: TTFT <= {s['ttft']:.2f} s, ITL p90 <= {s[key] * 1e3:.0f} ms")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("SLO attainment (%)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sensitivity(results: dict, s: dict, factors=(1.5, 2.0, 2.5, 3.0)) -> str:
    """Goodput of every deployment as the ITL SLO widens (TTFT SLO fixed), from the same runs."""
    names = list(results)
    lines = ["| ITL p90 SLO | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for f in factors:
        itl = f * s["base_itl"]
        cells = []
        for name in names:
            pts = {float(r): attainment(p["records"], s["ttft"], itl) for r, p in results[name]["points"].items()}
            cells.append(f"{measured_goodput(pts):g}")
        lines.append(f"| {f:g}x = {itl * 1e3:.0f} ms | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(results: dict, s: dict, args, plot_path: Path) -> str:
    lines = [
        f"Machine: {len(os.sched_getaffinity(0))} usable cores; weights {args.weights_dtype}; "
        f"prompts {args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens, outputs "
        f"{args.output_tokens[0]}-{args.output_tokens[1]} (ignore_eos); {args.requests} Poisson requests per "
        f"rate; seed {args.seed}.",
        "",
        f"SLOs (from the fastest aggregated deployment's unloaded TTFT {s['base_ttft'] * 1e3:.0f} ms and ITL "
        f"{s['base_itl'] * 1e3:.1f} ms): TTFT <= {s['ttft'] * 1e3:.0f} ms; tight ITL p90 <= "
        f"{s['tight_itl'] * 1e3:.0f} ms; loose ITL p90 <= {s['loose_itl'] * 1e3:.0f} ms.",
        "",
        "| deployment | unloaded TTFT (ms) | unloaded ITL (ms) | attainment tight / loose by rate | "
        "goodput tight (req/s) | goodput loose (req/s) |",
        "|---|---|---|---|---|---|",
    ]
    gp = {}
    for name, res in results.items():
        cells, tight, loose = [], {}, {}
        for r in sorted(res["points"], key=float):
            recs = res["points"][r]["records"]
            tight[float(r)] = attainment(recs, s["ttft"], s["tight_itl"])
            loose[float(r)] = attainment(recs, s["ttft"], s["loose_itl"])
            cells.append(f"{r}: {tight[float(r)] * 100:.0f}/{loose[float(r)] * 100:.0f}%")
        gp[name] = (measured_goodput(tight), measured_goodput(loose))
        u = res["unloaded"]
        lines.append(
            f"| {name} | {u['ttft'] * 1e3:.0f} | {u['itl'] * 1e3:.1f} | {'; '.join(cells)} | "
            f"{gp[name][0]:g} | {gp[name][1]:g} |"
        )
    aggs = {k: v for k, v in gp.items() if deployment(k)[0] == "aggregated"}
    if "disagg" in gp and aggs:
        lowest = min(args.rates)
        for i, label in ((0, "tight"), (1, "loose")):
            best_name = max(aggs, key=lambda k: aggs[k][i])
            best, dis = aggs[best_name][i], gp["disagg"][i]
            if best > 0:
                ratio = f"{dis / best:.2f}x"
            else:
                ratio = f"> {dis / lowest:.1f}x (aggregated below the lowest rate, {lowest})" if dis else "n/a"
            lines.append(
                f"\n{label} SLO: disaggregated goodput {dis:g} req/s vs best aggregated "
                f"({best_name}) {best:g}: {ratio}."
            )
    lines += ["", sensitivity(results, s), ""]
    lines += ["", f"![attainment vs rate]({plot_path.name})", "", "```", command_line("perf.goodput"), "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deployments", default="agg512,agg256,agg128,agg64,disagg")
    p.add_argument("--rates", default="0.1,0.2,0.3,0.45,0.65", help="request rates to sweep, ascending")
    p.add_argument("--requests", type=int, default=20, help="Poisson requests per rate")
    loadgen.add_workload_args(p, prompt_tokens=(256, 512), output_tokens=(32, 64))
    p.add_argument("--unloaded-requests", type=int, default=3)
    p.add_argument("--ttft-factor", type=float, default=3.0)
    p.add_argument("--tight-itl-factor", type=float, default=1.5)
    p.add_argument("--loose-itl-factor", type=float, default=3.0)
    p.add_argument("--ttft-slo", type=float, default=0.0, help="seconds (default: from --ttft-factor)")
    p.add_argument("--tight-itl-slo", type=float, default=0.0, help="seconds")
    p.add_argument("--loose-itl-slo", type=float, default=0.0, help="seconds")
    p.add_argument("--drain", type=float, default=120.0, help="seconds to wait for stragglers after the last arrival")
    p.add_argument("--weights-dtype", default="auto", help="weights_dtype (auto: serve's default)")
    p.add_argument("--from-json", default=None, help="report on a saved run instead of measuring")
    args = p.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        for k in ("prompt_tokens", "output_tokens", "requests", "seed", "weights_dtype", "rates"):
            setattr(args, k, saved["args"][k])
        plot_path = Path(args.from_json).with_suffix(".png")
        plot(saved["results"], saved["slo"], plot_path)
        print(report(saved["results"], saved["slo"], args, plot_path))
        return 0
    args.rates = sorted(float(r) for r in args.rates.split(","))
    args.stamp = time.strftime("%Y%m%d_%H%M%S")
    names = [n.strip() for n in args.deployments.split(",") if n.strip()]
    for n in names:
        deployment(n)
    tok = loadgen.load_tokenizer()
    out_dir = results_dir()
    results, unloaded_by = {}, {}
    for name in names:
        sweep(name, tok, args, unloaded_by, results)
    s = slos(unloaded_by, args)
    plot_path = out_dir / f"goodput_{args.stamp}.png"
    plot(results, s, plot_path)
    text = report(results, s, args, plot_path)
    (out_dir / f"goodput_{args.stamp}.json").write_text(
        json.dumps({"slo": s, "args": {k: v for k, v in vars(args).items()}, "results": results})
    )
    (out_dir / f"goodput_{args.stamp}.md").write_text(text)
    print(text)
    print(f"results: {out_dir / f'goodput_{args.stamp}.json'}")
    return 0 if all(math.isfinite(u["ttft"]) for u in unloaded_by.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
