"""Run NVIDIA perf_analyzer (``--streaming``) against the front model of a deployment.

perf_analyzer ships only in the manylinux ``tritonclient==2.50.0`` wheel; ``scripts/setup.sh``
unpacks it into ``.venv/perf_analyzer/``. It needs Debian's ``libb64-0d`` (installed here
with apt-get when missing and we are root) and ``libcudart.so.12`` (pip
``nvidia-cuda-runtime-cu12``, put on LD_LIBRARY_PATH here). This script starts the chosen
deployment itself unless ``--url`` points at a running server.

    python -m perf.perf_analyzer [--mode aggregated|disagg] [--concurrency 1:2] [--url HOST:PORT]
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PA = ROOT / ".venv" / "perf_analyzer" / "tritonclient-2.50.0.data" / "data" / "bin" / "perf_analyzer"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List five prime numbers.",
]


def ensure_libb64() -> None:
    if ctypes.util.find_library("b64"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SystemExit("perf_analyzer needs libb64-0d: run `apt-get install -y libb64-0d` as root")
    if subprocess.run(["apt-get", "install", "-y", "-q", "libb64-0d"]).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], check=True)  # a fresh machine has no package lists yet
        subprocess.run(["apt-get", "install", "-y", "-q", "libb64-0d"], check=True)


def pa_env() -> dict:
    import nvidia.cuda_runtime

    cudart = Path(list(nvidia.cuda_runtime.__path__)[0]) / "lib"
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(cudart), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def input_file(max_tokens: int, path: Path) -> Path:
    data = [
        {
            "text_input": {"content": [p], "shape": [1]},
            "max_tokens": {"content": [max_tokens], "shape": [1]},
            "stream": {"content": [True], "shape": [1]},
            "ignore_eos": {"content": [True], "shape": [1]},
        }
        for p in PROMPTS
    ]
    path.write_text(json.dumps({"data": data}))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["aggregated", "disagg"], default="aggregated")
    p.add_argument("--url", default=None, help="gRPC address of a running server (default: start one)")
    p.add_argument("--model-name", default="llm")
    p.add_argument("--concurrency", default="1:2")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests-per-window", type=int, default=8)
    args = p.parse_args(argv)
    if not PA.is_file():
        raise SystemExit(f"{PA} is missing; run scripts/setup.sh")
    ensure_libb64()
    tmp = Path(tempfile.mkdtemp(prefix="perf-analyzer-"))
    server = None
    if args.url is None:
        from perf import servers

        server = servers.start(args.mode, log_dir=tmp)
        url = server.grpc_url
    else:
        url = args.url
    cmd = [
        str(PA),
        "-m",
        args.model_name,
        "-u",
        url,
        "-i",
        "grpc",
        "--streaming",
        "--input-data",
        str(input_file(args.max_tokens, tmp / "inputs.json")),
        "--concurrency-range",
        args.concurrency,
        "--measurement-mode",
        "count_windows",
        "--measurement-request-count",
        str(args.requests_per_window),
        "--stability-percentage",
        "50",
        "--max-trials",
        "4",
        "-f",
        str(tmp / "perf_analyzer.csv"),
    ]
    print(" ".join(cmd), flush=True)
    try:
        rc = subprocess.run(cmd, env=pa_env()).returncode
    finally:
        if server is not None:
            server.stop()
    print(f"csv: {tmp / 'perf_analyzer.csv'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
