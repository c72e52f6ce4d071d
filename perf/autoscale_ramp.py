"""The autoscaler on a load ramp, against fixed deployments on the same trace.

A deployment here is a real one: etcd, one ``triton-disagg agent`` (which starts every prefill
and decode instance as a ``triton-disagg serve`` process of its own), ``triton-disagg
autoscale`` (its own process; for a fixed deployment min = max, so it only brings the
deployment up) and the OpenAI frontend with ``--discovery`` in front of every decode instance.
The trace (``ramp_trace``, ``perf/lib/loadgen.py``): Poisson arrivals whose rate changes by
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
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from backend.autoscale.actuator import AgentClient
from backend.cluster.records import InstanceRecord
from backend.disagg.auth import new_secret
from backend.launch.drain import members
from backend.launch.etcd_server import EtcdServer
from backend.launch.openai_frontend import OpenAIFrontend
from backend.planner.workload import TraceRequest
from perf.lib import loadgen
from perf.lib.loadgen import parse_phases, ramp_trace
from perf.lib.machine import ROOT, cpu_model
from perf.lib.results import results_dir
from perf.lib.stats import percentile

# float32 instances: the ramp's load phases and SLOs are sized to float32's step (with the faster
# fp16w default, 1.0 req/s left the SLO slack enough that a prefill instance was drained during
# the high phase). Requests queue for KV pages up to 60 s (page_wait_timeout_s, 10 s by default):
# longer than a scale-out takes, so a burst waits for the instance the autoscaler adds (it served
# 22-70 s after its start here under the high load; with 10 s, 7-20 of 247 requests were refused
# while it started). Leases at the default TTL (5 s; it was 3 s: a decode instance starved of CPU
# under the high load missed its renewal, and routers moved its 20 streams away). As many as 96
# requests may wait (max_waiting_for_pages, 32 by default): what 1.0 req/s brings in a minute, and
# more; with 32, a decode instance refused 33 requests in a CI run of a slower evening while the
# one the autoscaler added was starting (its pool held 25 requests, 32 waited).
INSTANCE_SETS = (
    "num_threads=1",
    "kv_cache_tokens=8192",
    "max_num_batched_tokens=256",
    "page_wait_timeout_s=60",
    "max_waiting_for_pages=96",
    "weights_dtype=float32",
)


@dataclass
class Result:
    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float = math.nan
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0  # streamed chunks with text
    completion_tokens: int = 0  # the usage the server reported
    error: str | None = None

    def met(self, ttft_s: float, itl_s: float) -> bool:
        return (
            self.error is None
            and self.completion_tokens == self.output_tokens
            and self.ttft_s <= ttft_s
            and (not self.gaps or percentile(self.gaps, 90) <= itl_s)
        )


def complete(url: str, req: TraceRequest, index: int, seed: int, timeout_s: float = 600.0) -> Result:
    """One streamed completion of ``req`` (its prompt: distinct random token ids)."""
    rng = random.Random(seed * 1_000_003 + index)
    prompt = [rng.randint(1000, 30000) for _ in range(req.prompt_tokens)]
    body = {
        "model": "llm",
        "prompt": prompt,
        "max_tokens": req.output_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    res = Result(index, req.arrival_s, req.prompt_tokens, req.output_tokens)
    t0 = time.monotonic()
    last = None
    try:
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                return res
            for line in resp.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = str(event["error"])[:300]
                    break
                if event.get("usage"):
                    res.completion_tokens = int(event["usage"].get("completion_tokens", 0))
                if not event.get("choices") or not event["choices"][0].get("text"):
                    continue
                now = time.monotonic()
                if last is None:
                    res.ttft_s = now - t0
                else:
                    res.gaps.append(now - last)
                last = now
                res.tokens += 1
    except requests.RequestException as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
    if res.error is None and res.completion_tokens != req.output_tokens:
        res.error = f"{res.completion_tokens} of {req.output_tokens} tokens"
    return res


def replay(
    url: str, trace: list[TraceRequest], seed: int = 0, progress: bool = True, label: str = "ramp"
) -> list[Result]:
    """Send each request at its arrival time (one thread each); wait for all. ``progress``: a
    progress line (requests finished / planned, labelled ``label``) when progress is shown."""
    results: list[Result | None] = [None] * len(trace)

    def send(i: int, _t_submit: float) -> None:
        results[i] = complete(url, trace[i], i, seed)

    offsets = [r.arrival_s for r in trace]
    loadgen.replay(offsets, send, drain_timeout_s=900, desc=label if progress else None, clock=time.monotonic)
    return [r for r in results if r is not None]


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


@dataclass
class Setup:
    ttft_s: float = 3.0
    itl_s: float = 0.3
    min_prefill: int = 1
    max_prefill: int = 2
    min_decode: int = 1
    max_decode: int = 2
    interval_s: float = 5.0
    cooldown_s: float = 30.0
    up_cooldown_s: float = 20.0
    scale_in_intervals: int = 3
    drain_timeout_s: float = 30.0
    profile: str = ""
    instance_sets: tuple[str, ...] = INSTANCE_SETS
    metrics_port: int = 0  # the autoscaler's /metrics (0: off)
    broken_agent: bool = False  # a second agent whose instances exit at once (a start that fails)


class RampDeployment:
    """etcd + agent + autoscaler + OpenAI frontend under ``tmp`` (``with`` starts and stops)."""

    def __init__(self, tmp: Path, model_dir: Path, setup: Setup, name: str = "ramp"):
        self.tmp, self.model_dir, self.setup, self.name = Path(tmp), Path(model_dir), setup, name
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.secret_file = self.tmp / "deploy.secret"
        self.secret_file.write_text(new_secret())
        self.secret_file.chmod(0o600)
        self.secret = self.secret_file.read_bytes().strip()
        self.decisions_file = self.tmp / "decisions.jsonl"
        self.etcd = EtcdServer(data_dir=self.tmp / "etcd", log_file=self.tmp / "etcd.log")
        self.procs: dict[str, subprocess.Popen] = {}
        self.frontend: OpenAIFrontend | None = None

    def _spawn(self, name: str, args: list[str]) -> None:
        out = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env
        )
        out.close()

    def members(self) -> list[InstanceRecord]:
        return members(self.etcd.url, "default", self.secret)

    def agents(self) -> list[AgentClient]:
        return [AgentClient(r, self.secret) for r in self.members() if r.role == "agent"]

    def serving(self) -> dict[str, int]:
        counts = {"prefill": 0, "decode": 0}
        for r in self.members():
            if r.role in counts and not r.draining:
                counts[r.role] += 1
        return counts

    def start(self, timeout_s: float = 400.0) -> RampDeployment:
        s = self.setup
        self.etcd.start()
        common = ["--discovery", self.etcd.url, "--deployment-secret-file", str(self.secret_file)]
        agent = ["agent", *common, "--max-instances", str(s.max_prefill + s.max_decode + 1)]
        agent += ["--drain-timeout", str(s.drain_timeout_s), "--log-dir", str(self.tmp / "instances")]
        agent += ["--model", str(self.model_dir)]
        for kv in s.instance_sets:
            agent += ["--set", kv]
        self._spawn("agent", agent)
        if s.broken_agent:
            broken = ["agent", *common, "--log-dir", str(self.tmp / "broken-instances")]
            self._spawn("broken-agent", broken + ["--model", str(self.tmp / "no-such-model")])
        scale = ["autoscale", *common, "--ttft", str(s.ttft_s), "--itl", str(s.itl_s)]
        scale += ["--min-prefill", str(s.min_prefill), "--max-prefill", str(s.max_prefill)]
        scale += ["--min-decode", str(s.min_decode), "--max-decode", str(s.max_decode)]
        scale += [
            "--interval",
            str(s.interval_s),
            "--cooldown",
            str(s.cooldown_s),
            "--up-cooldown",
            str(s.up_cooldown_s),
        ]
        scale += ["--scale-in-intervals", str(s.scale_in_intervals), "--decisions-file", str(self.decisions_file)]
        if s.profile:
            scale += ["--profile", s.profile]
        if s.metrics_port:
            scale += ["--metrics-port", str(s.metrics_port)]
        self._spawn("autoscale", scale)
        self.frontend = OpenAIFrontend(
            "127.0.0.1:1",
            self.model_dir,
            log_file=self.tmp / "openai.log",
            discovery=self.etcd.url,
            deployment="default",
            deployment_secret_file=self.secret_file,
        )
        self.frontend.start_process()
        deadline = time.monotonic() + timeout_s
        while True:
            n = self.serving()
            if n["prefill"] >= s.min_prefill and n["decode"] >= s.min_decode:
                break
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}; see {self.tmp / (name + '.log')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the deployment did not reach its minimum within {timeout_s:.0f} s: {n}")
            time.sleep(1.0)
        self.frontend._wait(120, lambda status: status == 200, "become healthy")
        return self

    def stop(self) -> None:
        for name in ("autoscale", "agent", "broken-agent"):  # an agent drains and stops its instances
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(self.setup.drain_timeout_s + 90)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.frontend is not None:
            self.frontend.stop()
        self.etcd.stop()

    def decisions(self) -> list[dict]:
        if not self.decisions_file.exists():
            return []
        return [json.loads(line) for line in self.decisions_file.read_text().splitlines() if line.strip()]

    def __enter__(self) -> RampDeployment:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


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
    with RampDeployment(tmp / name, model_dir, setup, name) as d:
        meter = InstanceMeter(d.agents).start()
        t0 = time.monotonic()
        assert d.frontend is not None
        results = replay(d.frontend.url, trace, seed, label=name)
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
