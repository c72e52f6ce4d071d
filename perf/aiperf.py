"""NVIDIA AIPerf against our deployments through the OpenAI-compatible API
(``/v1/chat/completions``, streaming), with goodput under a TTFT and an inter-token-latency SLO.

AIPerf lives in its own venv (``.venv/tools/aiperf``, made on first use). Each deployment is
started here (``perf/servers.py``) with the OpenAI frontend in front of it
(``backend/launch/openai_frontend.py``); synthetic prompts are tokenized with the local model's
tokenizer; every request asks for exactly ``--osl`` tokens (``ignore_eos``). Exports go to
``perf/results/aiperf/<mode>/`` and a summary table to ``perf/results/aiperf/summary.{json,md}``.

    python -m perf.aiperf [--modes aggregated,disagg] [--concurrency 2] [--requests 24] \\
        [--slo-ttft-ms 1000] [--slo-itl-ms 150]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from perf.tool_runs import parser, run_deployments, summarize
from perf.tool_venv import ROOT, ensure_tool

RESULTS = ROOT / "perf" / "results" / "aiperf"
AIPERF = "aiperf==0.13.0"
RATES = ("output_token_throughput", "request_throughput", "goodput")


def run_one(exe: Path, url: str, artifact_dir: Path, tokenizer: Path, args) -> dict:
    cmd = [
        str(exe),
        "profile",
        "--model",
        args.model_name,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        str(tokenizer),
        "--prompt-input-tokens-mean",
        str(args.isl),
        "--prompt-input-tokens-stddev",
        "0",
        "--prompt-output-tokens-mean",
        str(args.osl),
        "--extra-inputs",
        "ignore_eos:true",
        "--use-server-token-count",  # the chat template's tokens count as prompt tokens, as the server says
        "--concurrency",
        str(args.concurrency),
        "--request-count",
        str(args.requests),
        "--warmup-request-count",
        "2",
        "--goodput",
        f"time_to_first_token:{args.slo_ttft_ms} inter_token_latency:{args.slo_itl_ms}",
        "--output-artifact-dir",
        str(artifact_dir),
        "--no-auto-plot",
    ]
    print(" ".join(cmd), flush=True)
    artifact_dir.mkdir(parents=True, exist_ok=True)
    # AIPerf 0.13 refuses a local tokenizer folder in Hugging Face's offline mode (it validates the
    # path as a hub repo id); the folder is local, so nothing is fetched without it either
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    subprocess.run(cmd, check=True, cwd=artifact_dir.parent, env=env)
    exports = sorted(artifact_dir.rglob("profile_export_aiperf.json"))
    if not exports:
        raise RuntimeError(f"AIPerf wrote no profile_export_aiperf.json under {artifact_dir}")
    return summarize(json.loads(exports[-1].read_text()), RATES)


def main(argv=None) -> int:
    p = parser(__doc__, RESULTS, "base URL of a running OpenAI frontend")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-itl-ms", type=float, default=150.0)
    args = p.parse_args(argv)
    exe = ensure_tool("aiperf", AIPERF, "aiperf")
    from build_scripts.prepare_model import ensure_model

    tokenizer = ensure_model(None)

    def start(mode: str, log_dir: Path):
        if args.url:
            return args.url, None
        from backend.launch.openai_frontend import OpenAIFrontend
        from perf import servers

        server = servers.start(mode, log_dir=log_dir)
        frontend = OpenAIFrontend(server.grpc_url, tokenizer, log_file=log_dir / "openai.log")
        try:
            frontend.start()
        except Exception:
            server.stop()
            raise

        def stop():
            frontend.stop()
            server.stop()

        return frontend.url, stop

    settings = {k: getattr(args, k) for k in ("concurrency", "requests", "isl", "osl", "slo_ttft_ms", "slo_itl_ms")}
    return run_deployments(
        ["running"] if args.url else args.modes.split(","),
        Path(args.out),
        start,
        lambda url, artifact_dir: run_one(exe, url, artifact_dir, tokenizer, args),
        f"AIPerf {AIPERF.split('==')[1]}",
        settings,
        RATES,
    )


if __name__ == "__main__":
    sys.exit(main())
