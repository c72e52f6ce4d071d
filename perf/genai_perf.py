"""NVIDIA genai-perf against our deployments, over Triton's gRPC streaming API with the
TensorRT-LLM tensor names (``--endpoint-type kserve --backend tensorrtllm``: what older
genai-perf called ``--service-kind triton``), synthetic prompts tokenized with the local model's
tokenizer, fixed output length (``min_length`` = ``max_tokens``).

genai-perf drives NVIDIA perf_analyzer (from ``.venv/perf_analyzer``, see ``perf/lib/tools.py``)
and lives in its own venv (``.venv/tools/genai-perf``, made on first use). Each deployment is
started here (``perf/lib/servers.py``: aggregated on every core, or 1 prefill + 1 decode with the
cores split); its exports go to ``genai_perf/<mode>/`` in the results folder (``perf/results/``)
and a summary table to ``genai_perf/summary.{json,md}`` there.

    python -m perf.genai_perf [--modes aggregated,disagg] [--concurrency 2] [--requests 24]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from perf.lib.tools import PA, Tool, drive, ensure_perf_analyzer, load_options, pa_env, parser, profile

GENAI_PERF = "genai-perf==0.0.16"
RATES = ("output_token_throughput", "request_throughput")
TOOL = Tool("genai-perf", GENAI_PERF, "genai-perf", "genai_perf", "profile_export_genai_perf.json", RATES)


def run_one(exe: Path, url: str, artifact_dir: Path, tokenizer: Path, args) -> dict:
    """One genai-perf profile of the deployment at the gRPC address ``url``: its summary."""
    env = pa_env()
    env["PATH"] = os.pathsep.join((str(PA.parent), env.get("PATH", "")))
    cmd = [
        str(exe),
        "profile",
        "-m",
        args.model_name,
        "--endpoint-type",
        "kserve",
        "--backend",
        "tensorrtllm",
        "--streaming",
        "-u",
        url,
        "--tokenizer",
        str(tokenizer),
        "--synthetic-input-tokens-mean",
        str(args.isl),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(args.osl),
        "--output-tokens-mean-deterministic",
        *load_options(args),
        "--artifact-dir",
        str(artifact_dir),
        "--",  # to perf_analyzer: our optional inputs have shape [-1], name their one-element shape
        "--shape",
        "stream:1",
        "--shape",
        "min_length:1",
        "--shape",
        "exclude_input_in_output:1",
    ]
    return profile(TOOL, cmd, artifact_dir, env)


def main(argv=None) -> int:
    p = parser(__doc__, TOOL, "gRPC address of a running deployment")
    args = p.parse_args(argv)
    ensure_perf_analyzer()

    def start(mode: str, log_dir: Path, _model_dir: Path):
        from perf.lib import servers

        server = servers.start(mode, log_dir=log_dir)
        return server.grpc_url, lambda: servers.stop(server)

    return drive(args, TOOL, start, run_one, ("concurrency", "requests", "isl", "osl"))


if __name__ == "__main__":
    sys.exit(main())
