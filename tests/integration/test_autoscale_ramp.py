"""The autoscaler on a load ramp against a real deployment (real etcd, real ``triton-disagg
agent`` processes starting real ``triton-disagg serve`` servers, the real model, NIXL between
the prefill and decode servers, the OpenAI frontend routing across every decode instance, and
``triton-disagg autoscale`` as its own process):

- low, high, low Poisson load (about 3 minutes; prompts of 32..384 tokens, outputs of 16..48):
  the autoscaler brings the deployment up to its minimum, adds instances when the SLO is
  threatened (each decision logged with the figures that made it), drains them when the load
  falls, and not one request fails or comes back short;
- a second agent whose instances cannot start (its model does not exist) gets one of the first
  starts: the failure is reported and the instance is started on the other agent;
- the autoscaler exports desired and actual instances per role;
- killed with SIGKILL, the autoscaler leaves the deployment as it is, still serving.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from backend.autoscale.local_deployment import INSTANCE_SETS, AutoscaledDeployment, Setup, complete, stream_trace
from backend.planner.workload import Phase, ramp_trace
from tests.conftest import read_metrics

pytestmark = pytest.mark.usefixtures("nixl")

# The high load is 1.2 req/s (it was 0.6, then 1.0): on a faster CPU (an Intel Xeon, family 6
# model 167) 0.6 req/s threatened the SLO only 95-110 s into the high phase, and at 1.0 req/s
# once TTFT p90 passed 0.9 x the SLO barely (2.75 s) and fell back under it: the scale-out went
# to the broken agent and was then not needed again, so nothing was added or drained. The last low
# phase is 60 s (it was 210 s, then 90 s): the scale-in comes once the backlog of the high load
# is served, and the test waits up to 150 s more for it. At 1.2 req/s the SLO was threatened 5-10 s
# into the high phase (two runs on the Xeon, 2026-12-04/05), so the high phase is 90 s (it was
# 180 s: the longer it is, the longer the backlog that delays the scale-in; the whole test took
# 350-410 s).
PHASES = [Phase(40, 0.1), Phase(90, 1.2), Phase(60, 0.1)]


def _changes(decisions: list[dict]) -> int:
    """How many scaling changes (desired != current) the autoscaler has decided so far."""
    return sum(dd["current"] != dd["desired"] for x in decisions for dd in x["decisions"])


def test_the_deployment_grows_under_load_and_shrinks_after_without_losing_a_request(model_dir, tmp_path):
    from backend.launch.ports import free_port

    setup = Setup(
        ttft_s=3.0,
        itl_s=0.3,
        interval_s=5.0,
        cooldown_s=30.0,
        up_cooldown_s=20.0,
        scale_in_intervals=3,
        drain_timeout_s=30.0,
        metrics_port=free_port(),
        broken_agent=True,
        # a request waits for decode pages while the deployment is at its maximum (2 + 2) rather
        # than being refused after 60 s: on a Zen 3 (family 25 model 1) the high phase's prefill
        # backlog reached 57 s (p90) at the maximum, and 7 of 142 requests were refused with 429
        # "no KV pages free within 60s"; what this test checks is that scaling loses none
        instance_sets=tuple(s for s in INSTANCE_SETS if not s.startswith("page_wait_timeout_s="))
        + ("page_wait_timeout_s=300",),
    )
    trace = ramp_trace(PHASES, (32, 384), (16, 48), seed=1)
    with AutoscaledDeployment(tmp_path / "ramp", model_dir, setup) as d:
        assert d.frontend is not None
        t_start = time.time()
        results = stream_trace(d.frontend.url, trace, seed=1)
        # the load has fallen: wait for the scale-in, as long as the autoscaler makes progress:
        # its windowed TTFT still holds the high phase's for a while (p90 40 s on a loaded Zen 3,
        # where the first scale-in came 150 s after the trace); 300 s for its first change, 150 s
        # more after each change, 600 s at most
        start = time.monotonic()
        deadline, seen = start + 300, _changes(d.decisions())
        while d.serving() != {"prefill": 1, "decode": 1} and time.monotonic() < min(deadline, start + 600):
            time.sleep(2)
            if (now := _changes(d.decisions())) > seen:
                seen, deadline = now, max(deadline, time.monotonic() + 150)
        final = d.serving()
        # the autoscaler's gauges show what it saw at its last decision (every interval_s):
        # give it the intervals to see the deployment as it is now
        metrics_url = f"http://127.0.0.1:{setup.metrics_port}/metrics"
        deadline = time.monotonic() + 4 * setup.interval_s
        while _gauges(read_metrics(metrics_url), "_actual_instances") != final and time.monotonic() < deadline:
            time.sleep(1)
        metrics = read_metrics(metrics_url)
        decisions = d.decisions()
        # an autoscaler that dies leaves the deployment as it is
        d.procs["autoscale"].send_signal(signal.SIGKILL)
        d.procs["autoscale"].wait()
        time.sleep(8)
        after_kill = d.serving()
        still = complete(d.frontend.url, trace[0], 0, seed=2)
        log = (d.tmp / "autoscale.log").read_text()

    changes = [(x["t"] - t_start, dd) for x in decisions for dd in x["decisions"] if dd["current"] != dd["desired"]]
    print("decisions:")
    for t, dd in changes:
        print(f"  {t:7.1f} s {dd['role']} {dd['current']} -> {dd['desired']}: {dd['reason']}")
    failed = [r for r in results if r.error is not None]
    for r in failed:
        print(f"  failed: #{r.index} at {r.arrival_s:.1f} s, {r.prompt_tokens} prompt tokens: {r.error[:120]}")
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {[r.error for r in failed[:5]]}"
    assert len(results) == len(trace)
    high_start, high_end = PHASES[0].duration_s, PHASES[0].duration_s + PHASES[1].duration_s
    ups = [(t, dd) for t, dd in changes if dd["desired"] > dd["current"] and dd["current"] >= 1]
    downs = [(t, dd) for t, dd in changes if dd["desired"] < dd["current"]]
    assert ups, "no instance was added under the high load"
    assert all(("SLO" in dd["reason"] or "KV pools" in dd["reason"]) for _, dd in ups), ups
    assert any(high_start <= t <= high_end + 30 for t, _ in ups), f"no scale-out during the high phase: {ups}"
    assert downs, "no instance was drained after the load fell"
    assert all(t > high_end for t, _ in downs), f"a scale-in while the load was high: {downs}"
    assert all("intervals under" in dd["reason"] for _, dd in downs), downs
    assert final == {"prefill": 1, "decode": 1}, f"the deployment did not shrink back to its minimum: {final}"
    # every change is in the log with its reason; the drains too
    for _, dd in changes:
        assert f"autoscale: {dd['role']} {dd['current']} -> {dd['desired']}: " in log
    assert "autoscale: draining " in log
    # the start that failed (the broken agent's) was reported and replaced
    assert "without being stopped" in log, "the broken agent's instance exit was not reported"
    # exported per role
    gauges, desired = _gauges(metrics, "_actual_instances"), _gauges(metrics, "_desired_instances")
    assert gauges == {"prefill": 1.0, "decode": 1.0} and desired == {"prefill": 1.0, "decode": 1.0}, metrics
    assert after_kill == final, f"the deployment changed after the autoscaler died: {final} -> {after_kill}"
    assert still.error is None, still.error


def _gauges(metrics: dict, suffix: str) -> dict[str, float]:
    """role -> value of the autoscaler's per-role gauge whose name ends with ``suffix``."""
    return {dict(labels)["role"]: v for (n, labels), v in metrics.items() if n.endswith(suffix)}


def test_the_agent_refuses_an_unsigned_or_forged_request(tmp_path):
    """Outside the ramp: an agent's control API answers only requests proving the secret."""
    import subprocess
    import sys

    from backend.autoscale.actuator import ActuatorError, AgentClient
    from backend.disagg.auth import new_secret
    from backend.launch.drain import members
    from tests.conftest import private_etcd

    secret_file = tmp_path / "s"
    secret_file.write_text(new_secret())
    with private_etcd(tmp_path) as etcd:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "backend.cli",
                "agent",
                "--discovery",
                etcd.url,
                "--deployment-secret-file",
                str(secret_file),
                "--log-dir",
                str(tmp_path / "inst"),
            ],
            stdout=open(tmp_path / "agent.log", "wb"),
            stderr=subprocess.STDOUT,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        try:
            secret = secret_file.read_bytes().strip()
            deadline = time.monotonic() + 60
            agents = []
            while not agents and time.monotonic() < deadline:
                agents = [r for r in members(etcd.url, "default", secret) if r.role == "agent"]
                time.sleep(0.3)
            assert agents, "the agent never registered"
            url = agents[0].control_url
            assert requests.get(f"{url}/instances", timeout=5).status_code == 401
            assert requests.post(f"{url}/instances", json={"role": "decode"}, timeout=5).status_code == 401
            with pytest.raises(ActuatorError, match="401"):
                AgentClient(agents[0], new_secret().encode()).start("decode")
            assert AgentClient(agents[0], secret).instances() == []
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
