"""NVIDIA's benchmark tools run end to end against real deployments on a tiny load: genai-perf
over Triton's gRPC API (TensorRT-LLM tensor names), AIPerf over the OpenAI API with goodput.
Each installs into its own venv on first use (``perf/lib/tools.py``); the figures live in
``perf/history/REPORT-2026-12-02.md``."""

from __future__ import annotations

import json

from backend.launch.openai_frontend import OpenAIFrontend
from perf import aiperf, genai_perf

SMALL = ["--requests", "4", "--concurrency", "1", "--isl", "32", "--osl", "8"]


def _result(out) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    (result,) = summary["results"].values()
    assert "error" not in result, result
    return result


def test_genai_perf_against_triton(aggregated_server, tmp_path):
    assert genai_perf.main(["--url", aggregated_server.grpc_url, "--out", str(tmp_path), *SMALL]) == 0
    r = _result(tmp_path)
    assert r["time_to_first_token"]["p50"] > 0 and r["inter_token_latency"]["p50"] > 0
    assert r["output_token_throughput"]["avg"] > 0 and r["request_throughput"]["avg"] > 0


def test_aiperf_against_the_openai_api_with_goodput(aggregated_server, model_dir, tmp_path):
    frontend = OpenAIFrontend(aggregated_server.grpc_url, model_dir, log_file=tmp_path / "openai.log")
    frontend.start()
    try:
        rc = aiperf.main(["--url", frontend.url, "--out", str(tmp_path / "aiperf"), "--slo-ttft-ms", "60000", *SMALL])
    finally:
        frontend.stop()
    assert rc == 0
    r = _result(tmp_path / "aiperf")
    assert r["time_to_first_token"]["p50"] > 0 and r["request_throughput"]["avg"] > 0
    assert r["goodput"]["avg"] is not None and r["goodput"]["avg"] >= 0
