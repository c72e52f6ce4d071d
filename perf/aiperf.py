"""NVIDIA AIPerf against our deployments through the OpenAI-compatible API
(``/v1/chat/completions``, streaming), with goodput under a TTFT and an inter-token-latency SLO.

AIPerf lives in its own venv (``.venv/tools/aiperf``, made on first use). Each deployment is
started here (``perf/lib/servers.py``) with the OpenAI frontend in front of it
(``backend/launch/openai_frontend.py``); synthetic prompts are tokenized with the local model's
tokenizer; every request asks for exactly ``--osl`` tokens (``ignore_eos``). Exports go to
``aiperf/<mode>/`` in the results folder (``perf/results/``) and a summary table to
``aiperf/summary.{json,md}`` there; the shared driver is ``perf/lib/tools.py``.

    python -m perf.aiperf [--modes aggregated,disagg] [--concurrency 2] [--requests 24] \\
        [--slo-ttft-ms 1000] [--slo-itl-ms 150]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from perf.lib.tools import Tool, drive, load_options, parser, profile

AIPERF = "aiperf==0.13.0"
RATES = ("output_token_throughput", "request_throughput", "goodput")
TOOL = Tool("aiperf", AIPERF, "AIPerf", "aiperf", "profile_export_aiperf.json", RATES)


def run_one(exe: Path, url: str, artifact_dir: Path, tokenizer: Path, args) -> dict:
    """One AIPerf profile of the OpenAI frontend at ``url``: its summary."""
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
        *load_options(args),
        "--goodput",
        f"time_to_first_token:{args.slo_ttft_ms} inter_token_latency:{args.slo_itl_ms}",
        "--output-artifact-dir",
        str(artifact_dir),
        "--no-auto-plot",
    ]
    # AIPerf 0.13 refuses a local tokenizer folder in Hugging Face's offline mode (it validates the
    # path as a hub repo id); the folder is local, so nothing is fetched without it either
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return profile(TOOL, cmd, artifact_dir, env)


def main(argv=None) -> int:
    p = parser(__doc__, TOOL, "base URL of a running OpenAI frontend")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-itl-ms", type=float, default=150.0)
    args = p.parse_args(argv)

    def start(mode: str, log_dir: Path, model_dir: Path):
        """The deployment with the OpenAI frontend in front of it."""
        from perf.lib import servers

        server, frontend = servers.start_with_openai(mode, log_dir=log_dir, model=str(model_dir))

        def stop():
            servers.stop(server, frontend)

        return frontend.url, stop

    return drive(args, TOOL, start, run_one, ("concurrency", "requests", "isl", "osl", "slo_ttft_ms", "slo_itl_ms"))


if __name__ == "__main__":
    sys.exit(main())
