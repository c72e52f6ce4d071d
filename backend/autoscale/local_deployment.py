"""An autoscaled deployment on one machine, every part a process of its own: etcd, one
``triton-disagg agent`` (which starts every prefill and decode instance as a ``triton-disagg
serve`` process), optionally a second agent whose instances cannot start (its model does not
exist), ``triton-disagg autoscale``, and the OpenAI frontend with ``--discovery`` in front of
every decode instance; and a trace's requests streamed through that frontend at their arrival
times, each timed (TTFT, inter-token gaps) and checked against an SLO.
``triton-disagg bench autoscale`` (``perf/autoscale_ramp.py``) measures the autoscaler with it;
``tests/integration/test_autoscale_ramp.py`` drives it."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from backend.autoscale.actuator import AgentClient
from backend.cluster.records import InstanceRecord
from backend.disagg.auth import new_secret
from backend.launch.drain import members
from backend.launch.etcd_server import EtcdServer
from backend.launch.openai_frontend import OpenAIFrontend
from backend.planner.slo import SLO
from backend.planner.workload import TraceRequest, replay

ROOT = Path(__file__).resolve().parents[2]

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
        complete = self.error is None and self.completion_tokens == self.output_tokens
        return SLO(ttft_s, itl_s).attained(complete, self.ttft_s, self.gaps)


def complete(url: str, req: TraceRequest, index: int, seed: int, timeout_s: float = 600.0) -> Result:
    """One streamed completion of ``req`` (its prompt: distinct random token ids)."""
    rng = random.Random(seed * 1_000_003 + index)
    prompt = [rng.randint(1000, 30000) for _ in range(req.prompt_tokens)]
    body: dict[str, Any] = {
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


def stream_trace(
    url: str, trace: list[TraceRequest], seed: int = 0, on_done: Callable[[], object] | None = None
) -> list[Result]:
    """Send each request at its arrival time (one thread each) to the frontend at ``url``; wait
    for all. ``on_done``: called as each request finishes."""
    results: list[Result | None] = [None] * len(trace)

    def send(i: int, _t_submit: float) -> None:
        results[i] = complete(url, trace[i], i, seed)

    replay([r.arrival_s for r in trace], send, drain_timeout_s=900, on_done=on_done, clock=time.monotonic)
    return [r for r in results if r is not None]


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


class AutoscaledDeployment:
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

    def start(self, timeout_s: float = 400.0) -> AutoscaledDeployment:
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

    def __enter__(self) -> AutoscaledDeployment:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
