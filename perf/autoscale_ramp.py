"""The autoscaler on a load ramp, against fixed deployments on the same trace.

A deployment here is a real one (``backend/autoscale/local_deployment.py``): etcd, one
``triton-disagg agent`` (which starts every prefill and decode instance as a ``triton-disagg
serve`` process of its own), ``triton-disagg autoscale`` (its own process; for a fixed
deployment min = max, so it only brings the deployment up) and the OpenAI frontend with
``--discovery`` in front of every decode instance.
The trace (``ramp_trace``, ``backend/planner/workload.py``): Poisson arrivals whose rate changes by
phase (low, high, low), prompts of uniformly drawn lengths (distinct random token ids, so no
prefix is shared), outputs of drawn lengths with ``ignore_eos``. Each request is streamed
through ``/v1/completions``; what counts:

- SLO attainment: the share of requests with TTFT <= ``--ttft`` and p90 of their inter-token
  gaps <= ``--itl`` (a failed request misses);
- goodput per instance-second: requests that met the SLO divided by the instance-seconds the
  deployment used while the trace ran (every instance process the agent ran, starting and
  draining ones included, sampled every second);
- the autoscaler's predictions (arrival rate; with a profile, TTFT and ITL p90) against what the
  next interval measured, from its decisions file.

    python -m perf.autoscale_ramp --fixed 1:1,1:2 [--phases 120:0.1,240:0.6,180:0.1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from backend.autoscale.local_deployment import AutoscaledDeployment, Result, Setup, stream_trace
from backend.planner.stats import percentile
from backend.planner.workload import TraceRequest, parse_phases, ramp_trace
from perf.lib import loadgen
from perf.lib.machine import cpu_model
from perf.lib.progress import Progress
from perf.lib.results import results_dir


class InstanceMeter:
    """Instance-seconds of the agents' instance processes (alive ones), sampled every second."""

    def __init__(self, agents):
        self._agents = agents
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> InstanceMeter:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            counts = {"prefill": 0, "decode": 0}
            try:
                for client in self._agents():
                    for m in client.instances():
                        if m.alive and m.role in counts:
                            counts[m.role] += 1
            except Exception:
                continue
            self.samples.append((time.monotonic(), counts))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(5)
        if len(self.samples) < 2:
            return {"instance_seconds": math.nan, "mean_instances": math.nan}
        total = 0.0
        for (t0, c0), (t1, _) in zip(self.samples, self.samples[1:]):
            total += (t1 - t0) * sum(c0.values())
        span = self.samples[-1][0] - self.samples[0][0]
        return {
            "instance_seconds": total,
            "mean_instances": total / span,
            "max_instances": max(sum(c.values()) for _, c in self.samples),
            "timeline": [
                (round(t - self.samples[0][0], 1), c) for t, c in self.samples[:: max(1, len(self.samples) // 200)]
            ],
        }


def summarize(results: list[Result], usage: dict, setup: Setup, duration_s: float) -> dict:
    met = sum(r.met(setup.ttft_s, setup.itl_s) for r in results)
    ttft = [r.ttft_s for r in results if r.error is None and not math.isnan(r.ttft_s)]
    gaps = [g for r in results for g in r.gaps]
    return {
        "requests": len(results),
        "failed": sum(r.error is not None for r in results),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "slo_met": met,
        "attainment": met / len(results) if results else math.nan,
        "goodput_per_s": met / duration_s,
        "goodput_per_instance_s": met / usage["instance_seconds"] if usage.get("instance_seconds") else math.nan,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "itl_p90_s": percentile(gaps, 90),
        **{k: v for k, v in usage.items() if k != "timeline"},
    }


def predictions_vs_measured(decisions: list[dict]) -> dict:
    """Each interval's prediction set beside the next interval's measurement (decode figures)."""
    rows = []
    for prev, cur in zip(decisions, decisions[1:]):
        obs = cur.get("observed", {}).get("decode", {})
        pred = prev.get("predicted_load", {})
        model = prev.get("model_prediction", {})
        rows.append(
            {
                "t": cur["t"],
                "rate_predicted": pred.get("arrivals_per_s"),
                "rate_measured": obs.get("arrivals_per_s"),
                "ttft_p90_predicted": model.get("ttft_p90_s"),
                "ttft_p90_measured": obs.get("ttft_p90_s"),
                "itl_p90_predicted": model.get("itl_p90_s"),
                "itl_p90_measured": obs.get("itl_p90_s"),
            }
        )

    def err(a: str, b: str) -> dict:
        pairs = [(r[a], r[b]) for r in rows if r[a] is not None and r[b] is not None and r[b] > 0]
        rel = [abs(x - y) / y for x, y in pairs]
        return {
            "intervals": len(pairs),
            "median_rel_error": percentile(rel, 50) if rel else None,
            "within_25pct": sum(e <= 0.25 for e in rel),
        }

    return {
        "rate": err("rate_predicted", "rate_measured"),
        "ttft_p90": err("ttft_p90_predicted", "ttft_p90_measured"),
        "itl_p90": err("itl_p90_predicted", "itl_p90_measured"),
        "rows": rows,
    }


def run_one(tmp: Path, model_dir: Path, setup: Setup, trace: list[TraceRequest], name: str, seed: int) -> dict:
    print(
        f"{name}: starting (prefill {setup.min_prefill}..{setup.max_prefill}, decode "
        f"{setup.min_decode}..{setup.max_decode})",
        flush=True,
    )
    with AutoscaledDeployment(tmp / name, model_dir, setup, name) as d:
        meter = InstanceMeter(d.agents).start()
        t0 = time.monotonic()
        assert d.frontend is not None
        with Progress(len(trace), name, unit="req") as progress:
            results = stream_trace(d.frontend.url, trace, seed, on_done=progress.update)
        duration = time.monotonic() - t0
        usage = meter.stop()
        decisions = d.decisions()
    out = summarize(results, usage, setup, duration)
    out.update(
        name=name,
        duration_s=duration,
        timeline=usage.get("timeline", []),
        changes=[
            {"t": x["t"], "role": dd["role"], "from": dd["current"], "to": dd["desired"], "reason": dd["reason"]}
            for x in decisions
            for dd in x["decisions"]
            if dd["current"] != dd["desired"]
        ],
        predictions=predictions_vs_measured(decisions),
        results=[asdict(r) for r in results],
    )
    brief = ("requests", "failed", "attainment", "goodput_per_instance_s", "mean_instances")
    print(f"{name}: {json.dumps({k: out[k] for k in brief})}", flush=True)
    return out


def _s(v, digits: int = 2) -> str:
    """Seconds as a table cell; '-' where there is no figure (no request measured)."""
    return "-" if v is None else f"{v:.{digits}f}"


def tables(report: dict) -> str:
    """The runs side by side, each run's scaling changes and its predictions against measurement,
    as markdown."""
    slo = report["slo"]
    out = [
        f"Trace {report['phases']} (seconds:req/s), {report['requests']} requests; SLO TTFT <= {slo['ttft_s']} s "
        f"and the request's p90 inter-token gap <= {slo['itl_p90_s']} s:",
        "",
        "| deployment | mean instances | SLO attainment | met / s | goodput per instance-second "
        "| TTFT p50 / p90 (s) | ITL p90 (s) | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        out.append(
            f"| {r['name']} | {r['mean_instances']:.2f} | {100 * r['attainment']:.1f} % ({r['slo_met']} of "
            f"{r['requests']}) | {r['goodput_per_s']:.3f} | {r['goodput_per_instance_s']:.4f} | "
            f"{_s(r['ttft_p50_s'])} / {_s(r['ttft_p90_s'])} | {_s(r['itl_p90_s'], 3)} | {r['failed']} |"
        )
    for r in report["runs"]:
        changes = r.get("changes") or []
        if changes:
            first = changes[0]["t"]
            out += ["", f"{r['name']}: what the autoscaler changed (seconds from its first decision):", ""]
            out += ["| t (s) | change | reason |", "|---|---|---|"]
            for c in changes:
                reason = c["reason"][:160].replace("|", "/")
                out.append(f"| {c['t'] - first:.0f} | {c['role']} {c['from']} -> {c['to']} | {reason} |")
        pred = r.get("predictions") or {}
        if any(pred.get(k, {}).get("intervals") for k in ("rate", "ttft_p90", "itl_p90")):
            out += ["", f"{r['name']}: each interval's prediction against the next interval's measurement:", ""]
            out += ["| figure | intervals | median relative error | within 25 % |", "|---|---|---|---|"]
            for key, title in (("rate", "arrival rate"), ("ttft_p90", "TTFT p90"), ("itl_p90", "ITL p90")):
                e = pred.get(key, {})
                med = e.get("median_rel_error")
                out.append(
                    f"| {title} | {e.get('intervals', 0)} | {'-' if med is None else f'{100 * med:.0f} %'} | "
                    f"{e.get('within_25pct', 0)} |"
                )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    from build_scripts.prepare_model import ensure_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default="120:0.1,240:0.6,180:0.1", help="seconds:rate,... (requests/s)")
    loadgen.add_workload_args(p, prompt_tokens=(32, 384), output_tokens=(16, 48))
    p.add_argument("--ttft", type=float, default=3.0)
    p.add_argument("--itl", type=float, default=0.3)
    p.add_argument("--max-prefill", type=int, default=2)
    p.add_argument("--max-decode", type=int, default=2)
    p.add_argument("--fixed", default="1:1,1:2", help="fixed deployments to compare, prefill:decode,...")
    p.add_argument("--profile", default="", help="engine profile for the autoscaler's model")
    p.add_argument("--out", default=None, help="the JSON report (default: in the results folder)")
    args = p.parse_args(argv)
    model_dir = ensure_model(None)
    trace = ramp_trace(parse_phases(args.phases), tuple(args.prompt_tokens), tuple(args.output_tokens), args.seed)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    tmp = Path(tempfile.mkdtemp(prefix=f"autoscale-ramp-{stamp}-"))  # etcd, logs, decisions
    print(f"deployment files (etcd, logs, the autoscaler's decisions): {tmp}", flush=True)
    base = dict(ttft_s=args.ttft, itl_s=args.itl, profile=args.profile)
    runs = [
        run_one(
            tmp,
            model_dir,
            Setup(**base, max_prefill=args.max_prefill, max_decode=args.max_decode),
            trace,
            "autoscaled",
            args.seed,
        )
    ]
    for spec in filter(None, args.fixed.split(",")):
        pre, dec = map(int, spec.split(":"))
        setup = Setup(**base, min_prefill=pre, max_prefill=pre, min_decode=dec, max_decode=dec)
        runs.append(run_one(tmp, model_dir, setup, trace, f"fixed {pre}P:{dec}D", args.seed))
    cpu = cpu_model()
    report = {
        "phases": args.phases,
        "requests": len(trace),
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "slo": {"ttft_s": args.ttft, "itl_p90_s": args.itl},
        "cpu": cpu,
        "cores": os.cpu_count(),
        "runs": runs,
    }
    out = Path(args.out) if args.out else results_dir() / f"autoscale-ramp-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(tables(report))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
