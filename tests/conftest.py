"""Shared fixtures: the real model checkpoint and real Triton servers (stopped by PID)."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import requests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from build_scripts.prepare_model import ensure_model
    return ensure_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


def read_metrics(url: str) -> dict:
    """Parse Prometheus text into {(name, frozenset(labels)): value}."""
    out = {}
    for line in requests.get(url, timeout=5).text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(\w+)(?:\{(.*)\})?\s+(\S+)$", line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric_values(url: str, name: str, **labels) -> list[float]:
    want = set(labels.items())
    return [v for (n, lab), v in read_metrics(url).items() if n == name and want <= set(lab)]


def wait_pool_free(url: str, model: str, timeout_s: float = 30.0) -> None:
    """Wait until every instance of ``model`` reports all KV pages free; fail with the figures."""
    deadline = time.monotonic() + timeout_s
    while True:
        total = metric_values(url, "triton_disagg_kv_pages_total", model=model)
        free = metric_values(url, "triton_disagg_kv_pages_free", model=model)
        if total and sum(total) > 0 and sum(total) == sum(free):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV pool of {model} not back to all free: total {total}, free {free}")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def aggregated_server(model_dir, tmp_path_factory):
    """A real tritonserver with the aggregated ``llm`` model, small limits for the fault tests."""
    from backend.deployment import render_deployment
    from backend.server import TritonServer

    tmp = tmp_path_factory.mktemp("agg")
    repo = render_deployment(tmp / "repo", mode="aggregated", model_path=str(model_dir), overrides={
        "kv_cache_tokens": "4096", "max_tokens_limit": "256", "max_queue_size": "16",
        "max_num_batched_tokens": "128", "num_threads": "2"})
    server = TritonServer(repo, log_file=tmp / "tritonserver.log")
    try:
        server.start(timeout_s=300)
        yield server
    finally:
        server.stop()
        print(f"tritonserver log: {tmp / 'tritonserver.log'}")
