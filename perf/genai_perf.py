"""NVIDIA genai-perf against our deployments, over Triton's gRPC streaming API with the
TensorRT-LLM tensor names (``--endpoint-type kserve --backend tensorrtllm``: what older
genai-perf called ``--service-kind triton``), synthetic prompts tokenized with the local model's
tokenizer, fixed output length (``min_length`` = ``max_tokens``).

genai-perf drives NVIDIA perf_analyzer (from ``.venv/perf_analyzer``, see ``perf/perf_analyzer.py``)
and lives in its own venv (``.venv/tools/genai-perf``, made on first use). Each deployment is
started here (``perf/servers.py``: aggregated on every core, or 1 prefill + 1 decode with the
cores split); its exports go to ``perf/results/genai_perf/<mode>/`` and a summary table to
``perf/results/genai_perf/summary.{json,md}``.

    python -m perf.genai_perf [--modes aggregated,disagg] [--concurrency 2] [--requests 24]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from perf.perf_analyzer import PA, ensure_libb64, pa_env
from perf.tool_runs import parser, run_deployments, summarize
from perf.tool_venv import ROOT, ensure_tool

RESULTS = ROOT / "perf" / "results" / "genai_perf"
GENAI_PERF = "genai-perf==0.0.16"
RATES = ("output_token_throughput", "request_throughput")


def run_one(exe: Path, url: str, artifact_dir: Path, tokenizer: Path, args) -> dict:
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
        "--concurrency",
        str(args.concurrency),
        "--request-count",
        str(args.requests),
        "--warmup-request-count",
        "2",
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
    print(" ".join(cmd), flush=True)
    artifact_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(cmd, env=env, check=True, cwd=artifact_dir.parent)
    exports = sorted(artifact_dir.rglob("profile_export_genai_perf.json"))
    if not exports:
        raise RuntimeError(f"genai-perf wrote no profile_export_genai_perf.json under {artifact_dir}")
    return summarize(json.loads(exports[-1].read_text()), RATES)


def main(argv=None) -> int:
    p = parser(__doc__, RESULTS, "gRPC address of a running deployment")
    args = p.parse_args(argv)
    if not PA.is_file():
        raise SystemExit(f"{PA} is missing; run scripts/setup.sh")
    ensure_libb64()
    exe = ensure_tool("genai-perf", GENAI_PERF, "genai-perf")
    from build_scripts.prepare_model import ensure_model

    tokenizer = ensure_model(None)

    def start(mode: str, log_dir: Path):
        if args.url:
            return args.url, None
        from perf import servers

        server = servers.start(mode, log_dir=log_dir)
        return server.grpc_url, server.stop

    return run_deployments(
        ["running"] if args.url else args.modes.split(","),
        Path(args.out),
        start,
        lambda url, artifact_dir: run_one(exe, url, artifact_dir, tokenizer, args),
        f"genai-perf {GENAI_PERF.split('==')[1]}",
        {k: getattr(args, k) for k in ("concurrency", "requests", "isl", "osl")},
        RATES,
    )


if __name__ == "__main__":
    sys.exit(main())
