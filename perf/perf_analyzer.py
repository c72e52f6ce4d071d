"""Run NVIDIA perf_analyzer (``--streaming``) against the front model of a deployment.

perf_analyzer ships only in the manylinux ``tritonclient==2.50.0`` wheel; ``scripts/setup.sh``
unpacks it into ``.venv/perf_analyzer/``. It needs Debian's ``libb64-0d`` (installed with
apt-get when missing and we are root) and ``libcudart.so.12`` (pip ``nvidia-cuda-runtime-cu12``,
put on LD_LIBRARY_PATH): ``perf/lib/tools.py`` sees to both. This script starts the chosen
deployment itself unless ``--url`` points at a running server. Its CSV, and the same rows as
JSON (``perf_analyzer_<stamp>.json``, the figures of the run's envelope), go to the results
folder.

    python -m perf.perf_analyzer [--mode aggregated|disagg] [--concurrency 1:2] [--url HOST:PORT]
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from perf.lib.results import results_dir
from perf.lib.tools import ensure_perf_analyzer, pa_env

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List five prime numbers.",
]


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


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def table(rows: list[dict], max_tokens: int) -> str:
    """perf_analyzer's rows as markdown: requests/s, responses (one per token)/s and its latency
    percentiles in ms."""
    out = [
        f"perf_analyzer --streaming, {max_tokens} tokens per request:",
        "",
        "| concurrency | requests/s | responses/s | latency p50 / p90 / p99 (ms) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lat = " / ".join(f"{r[f'p{q} latency'] / 1e3:.0f}" for q in (50, 90, 99))
        out.append(
            f"| {int(r['Concurrency'])} | {r['Inferences/Second']:.3f} | {r['Response Throughput']:.2f} | {lat} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["aggregated", "disagg"], default="aggregated")
    p.add_argument("--url", default=None, help="gRPC address of a running server (default: start one)")
    p.add_argument("--model-name", default="llm")
    p.add_argument("--concurrency", default="1:2")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests-per-window", type=int, default=8)
    p.add_argument(
        "--stability-percentage",
        type=float,
        default=50,
        help="how far (%%) the last three windows may spread and still count as stable (default 50)",
    )
    p.add_argument("--max-trials", type=int, default=4, help="windows tried before giving up (default 4)")
    args = p.parse_args(argv)
    pa = ensure_perf_analyzer()
    tmp = Path(tempfile.mkdtemp(prefix="perf-analyzer-"))
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    csv_path = out / f"perf_analyzer_{stamp}.csv"
    from perf.lib import servers

    server = None
    if args.url is None:
        server = servers.start(args.mode, log_dir=tmp)
        url = server.grpc_url
    else:
        url = args.url
    cmd = [
        str(pa),
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
        f"{args.stability_percentage:g}",
        "--max-trials",
        str(args.max_trials),
        "-f",
        str(csv_path),
    ]
    print(" ".join(cmd), flush=True)
    try:
        rc = subprocess.run(cmd, env=pa_env()).returncode
    finally:
        if server is not None:
            servers.stop(server)
    if rc == 0 and csv_path.exists():
        rows = [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(csv_path.open())]
        summary = {"mode": None if args.url else args.mode, "url": args.url, "max_tokens": args.max_tokens}
        summary["rows"] = rows
        csv_path.with_suffix(".json").write_text(json.dumps(summary, indent=1))
        print(table(rows, args.max_tokens))
    print(f"csv: {csv_path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
