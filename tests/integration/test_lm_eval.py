"""lm-evaluation-harness (``local-completions``) against the OpenAI frontend of real deployments,
aggregated and disaggregated (1 prefill + 1 decode, every prefill over the KV fabric): this
repository's task group ``td_smoke`` (``tests/data/lm_eval/``: multiple choice by
loglikelihood, word perplexity by loglikelihood_rolling, short greedy answers by
generate_until). The scores agree across the modes and are sane. lm-eval runs as a user runs
it, ``triton-disagg bench lm-eval --url FRONTEND`` (a process of its own; it installs lm-eval on
first use into ``.venv/tools/lm-eval``), and its output files are read here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend.launch.openai_frontend import OpenAIFrontend
from tests.conftest import deployment_server

# the first run installs lm-eval (minutes) inside the first test's setup
pytestmark = pytest.mark.timeout(1500)

PPL_RTOL = 1e-3  # float32 everywhere; the modes differ only in prefill chunking and the KV transfer
LL_ATOL = 1e-3  # per-request loglikelihood (nats), summed over at most ~60 tokens


@pytest.fixture(scope="module")
def small_disagg_server(model_dir, tmp_path_factory):
    """The smallest disaggregated deployment: 1 prefill + 1 decode instance, small prefill chunks."""
    with deployment_server(
        tmp_path_factory,
        "lm-eval-disagg",
        timeout_s=400,
        mode="disagg",
        model_path=str(model_dir),
        overrides={"kv_cache_tokens": "4096", "max_num_batched_tokens": "32", "max_tokens_limit": "256"},
    ) as server:
        yield server


def _evaluate(server, model_dir, tmp_path_factory, name: str) -> dict:
    tmp = tmp_path_factory.mktemp(f"lm-eval-{name}")
    frontend = OpenAIFrontend(server.grpc_url, model_dir, log_file=tmp / "openai.log")
    frontend.start()
    out = tmp / "out"
    try:
        cmd = [sys.executable, "-m", "backend.cli", "bench", "lm-eval", "--url", frontend.url, "--out", str(out)]
        cmd += ["--model", frontend.served_model_name, "--tokenizer", str(model_dir)]
        env = {**os.environ, "TRITON_DISAGG_RESULTS": str(tmp / "results")}  # not the tracked perf/runs/
        root = Path(__file__).resolve().parents[2]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    finally:
        frontend.stop()
    (results,) = out.rglob("results_*.json")
    samples = {
        f.name.removeprefix("samples_").rsplit("_", 1)[0]: [json.loads(line) for line in f.read_text().splitlines()]
        for f in results.parent.glob("samples_*.jsonl")
    }
    return {"results": json.loads(results.read_text())["results"], "samples": samples}


@pytest.fixture(scope="module")
def scores(aggregated_server, small_disagg_server, model_dir, tmp_path_factory) -> dict:
    out = {
        "aggregated": _evaluate(aggregated_server, model_dir, tmp_path_factory, "agg"),
        "disagg": _evaluate(small_disagg_server, model_dir, tmp_path_factory, "disagg"),
    }
    for mode, res in out.items():
        print(mode, {task: res["results"][task] for task in ("td_mc", "td_ppl", "td_gen")})
    return out


def _metric(res: dict, task: str, name: str) -> float:
    return res["results"][task][f"{name},{'strip' if task == 'td_gen' else 'none'}"]


def _loglikelihoods(res: dict, task: str) -> list[float]:
    """Each logged request's loglikelihood, in document and choice order."""
    docs = sorted(res["samples"][task], key=lambda s: s["doc_id"])
    return [float(r[0]) if isinstance(r, list) else float(r) for s in docs for r in s["filtered_resps"]]


def test_multiple_choice_agrees_across_modes_and_beats_chance(scores):
    agg, dis = scores["aggregated"], scores["disagg"]
    for metric in ("acc", "acc_norm"):
        assert _metric(agg, "td_mc", metric) == _metric(dis, "td_mc", metric), metric
    a, d = _loglikelihoods(agg, "td_mc"), _loglikelihoods(dis, "td_mc")
    assert len(a) == len(d) == 8 * 4
    assert all(math.isfinite(x) and x < 0 for x in a), a
    assert max(abs(x - y) for x, y in zip(a, d)) < LL_ATOL, list(zip(a, d))
    assert _metric(agg, "td_mc", "acc") > 0.25, "no better than chance on 8 easy 4-way questions"


def test_word_perplexity_agrees_across_modes_and_is_plausible(scores):
    agg, dis = scores["aggregated"], scores["disagg"]
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        a, d = _metric(agg, "td_ppl", metric), _metric(dis, "td_ppl", metric)
        assert math.isfinite(a) and a > 0, (metric, a)
        assert abs(a - d) <= PPL_RTOL * a, (metric, a, d)
    a, d = _loglikelihoods(agg, "td_ppl"), _loglikelihoods(dis, "td_ppl")
    assert len(a) == len(d) == 4 and max(abs(x - y) for x, y in zip(a, d)) < LL_ATOL, list(zip(a, d))
    # ordinary English paragraphs: a 135M model is far from uniform over 49k tokens
    assert 1.0 < _metric(agg, "td_ppl", "word_perplexity") < 300
    assert 1.0 < _metric(agg, "td_ppl", "byte_perplexity") < 4


def test_greedy_answers_identical_across_modes(scores):
    agg, dis = scores["aggregated"], scores["disagg"]
    assert _metric(agg, "td_gen", "exact_match") == _metric(dis, "td_gen", "exact_match")
    texts = {
        mode: [s["resps"][0][0] for s in sorted(r["samples"]["td_gen"], key=lambda s: s["doc_id"])]
        for mode, r in scores.items()
    }
    print(texts)
    assert len(texts["aggregated"]) == 4 and any(t.strip() for t in texts["aggregated"]), texts
    assert texts["aggregated"] == texts["disagg"]
