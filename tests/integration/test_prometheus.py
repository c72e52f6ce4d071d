"""A real Prometheus (Debian's, started by the launcher as ``serve --prometheus`` does) against a
real disaggregated deployment: every server of the membership is a scrape target that is up; a
server that joins becomes one, and one that leaves stops being one, without a restart; every
recording and alert rule of ``deploy/prometheus/triton-disagg-rules.yml`` evaluates, and the
recording rules give values once requests ran; every query of the Grafana dashboard
(``deploy/grafana/triton-disagg.json``) names a metric that a live ``/metrics`` (the servers', the
OpenAI frontend's, the autoscaler's) exports, or a recording rule that Prometheus loaded."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from backend.client import stream_generate
from backend.disagg.auth import SECRET_ENV
from backend.launch.ports import free_port
from backend.launch.prometheus_server import prometheus_binary
from tests.conftest import PROMPTS, deployment_server
from tests.skips import missing_setup

pytestmark = pytest.mark.usefixtures("prometheus_installed")
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "triton-disagg.json"
OVERRIDES = {"kv_cache_tokens": "1024", "num_threads": "1"}


@pytest.fixture(scope="session")
def prometheus_installed():
    """Debian's prometheus, which scripts/setup.sh installs: missing, the tests skip, or fail in CI."""
    if prometheus_binary() is None:
        missing_setup("prometheus is not installed (Debian's)")


@pytest.fixture(scope="module")
def watched(model_dir, tmp_path_factory):
    with deployment_server(
        tmp_path_factory, "prometheus", mode="disagg", model_path=str(model_dir), overrides=OVERRIDES, prometheus_port=0
    ) as server:
        assert server.prometheus is not None
        yield server


def _api(server, path: str, **params) -> dict:
    reply = requests.get(f"{server.prometheus.url}/api/v1/{path}", params=params, timeout=10)
    reply.raise_for_status()
    return reply.json()["data"]


def _up_targets(server) -> dict[str, str]:
    """Scrape address -> health, of the targets Prometheus scrapes now."""
    return {t["labels"]["instance"]: t["health"] for t in _api(server, "targets")["activeTargets"]}


def _wait(what: str, predicate, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(1.0)


def _address(metrics_url: str) -> str:
    return metrics_url.split("://", 1)[1].split("/", 1)[0]


def test_every_server_is_a_target_and_one_that_joins_or_leaves_follows_without_a_restart(
    watched, model_dir, tmp_path_factory
):
    server = watched
    pid = server.prometheus.proc.pid
    here = _address(server.metrics_url)
    _wait("the deployment's server is an up target", lambda: _up_targets(server).get(here) == "up")
    assert server.etcd is not None
    with deployment_server(
        tmp_path_factory,
        "prometheus-joins",
        mode="decode",
        model_path=str(model_dir),
        overrides=OVERRIDES,
        discovery=server.etcd.url,
        extra_env={SECRET_ENV: server.deployment_secret},
    ) as joined:
        there = _address(joined.metrics_url)
        targets = _wait("the server that joined is an up target", lambda: _up_targets(server).get(there) == "up")
        assert targets and _up_targets(server).get(here) == "up"
    _wait("the server that left is no target", lambda: there not in _up_targets(server), timeout_s=60)
    assert server.prometheus.proc.pid == pid  # the same Prometheus all along: no restart


def test_every_rule_evaluates_and_the_recording_rules_have_values(watched):
    server = watched
    for prompt in PROMPTS[:4]:
        assert stream_generate(server.grpc_url, prompt, 8, ignore_eos=True).error is None

    def evaluated() -> list | None:
        rules = [r for g in _api(server, "rules")["groups"] for r in g["rules"]]
        fresh = all(r["health"] == "ok" and not r["lastEvaluation"].startswith("0001") for r in rules)
        return rules if rules and fresh else None

    rules = _wait("every rule evaluated without an error", evaluated)
    names = {r["name"] for r in rules}
    assert {"TritonDisaggTTFTSLOBurn", "TritonDisaggKVPoolNearlyFull", "TritonDisaggInstanceMissing"} <= names
    assert {"TritonDisaggMigrationsRising", "model:triton_disagg_goodput_requests:rate1m"} <= names

    def has_value(name: str, model: str):
        return lambda: [s for s in _api(server, "query", query=name)["result"] if s["metric"].get("model") == model]

    for name, model in (
        ("model:triton_disagg_requests:rate1m", "decode_0"),
        ("model:triton_disagg_time_to_first_token_seconds:p99_1m", "decode_0"),
        ("model:triton_disagg_inter_token_latency_seconds:p90_1m", "decode_0"),
        ("model:triton_disagg_kv_pages_free:ratio", "prefill_0"),
    ):
        _wait(f"{name} for {model}", has_value(name, model), timeout_s=120)


PROMQL_WORDS = {
    "sum", "by", "rate", "increase", "histogram_quantile", "without", "le", "model", "role", "reason",
    "direction", "job", "instance", "roles", "avg", "max", "min", "on", "ignoring",
}  # fmt: skip


def _metric_names(text: str) -> set[str]:
    """The sample names of a Prometheus text exposition."""
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_dashboard_query_names_a_live_metric_or_a_loaded_rule(watched, model_dir, tmp_path):
    server = watched
    from backend.launch.openai_frontend import OpenAIFrontend

    assert server.etcd is not None
    env = {SECRET_ENV: server.deployment_secret}
    frontend = OpenAIFrontend(server.grpc_url, model_dir, discovery=server.etcd.url, extra_env=env)
    port = free_port()
    autoscaler = subprocess.Popen(
        [sys.executable, "-m", "backend.cli", "autoscale", "--discovery", server.etcd.url, "--ttft", "5", "--itl", "1",
         "--interval", "2", "--metrics-port", str(port), "--max-prefill", "1", "--max-decode", "1"],
        env={**os.environ, **env}, stdout=open(tmp_path / "autoscale.log", "wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        frontend.start()
        live = _metric_names(requests.get(server.metrics_url, timeout=10).text)
        live |= _metric_names(requests.get(f"{frontend.url}/metrics", timeout=10).text)
        scraped = _wait(
            "the autoscaler's /metrics",
            lambda: _autoscaler_metrics(port) if autoscaler.poll() is None else pytest.fail("autoscale exited"),
        )
        live |= _metric_names(scraped) | {"up"}
    finally:
        frontend.stop()
        autoscaler.terminate()
        autoscaler.wait(10)
    rules = {r["name"]: r["query"] for g in _api(server, "rules")["groups"] for r in g["rules"]}
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(queries) >= 20 and len(dashboard["panels"]) >= 12
    missing = []
    for query in queries + [q for name, q in rules.items() if name.startswith("model:")]:
        for name in set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", re.sub(r'"[^"]*"|\[[^\]]*\]', "", query))):
            if name in PROMQL_WORDS or name in live or name in rules:
                continue
            missing.append((name, query))
    assert not missing, missing


def _autoscaler_metrics(port: int) -> str | None:
    try:
        reply = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
    except requests.RequestException:
        return None
    text = reply.text if reply.status_code == 200 else ""
    return text if "triton_disagg_autoscaler_decisions_total" in _metric_names(text) else None  # a decision made
