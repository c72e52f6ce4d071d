"""lm-evaluation-harness against a running OpenAI frontend (``local-completions``: token-id
prompts, ``echo`` + ``logprobs`` for the loglikelihood tasks, greedy generation for the
``generate_until`` ones). lm-eval installs on first use into its own venv,
``.venv/tools/lm-eval`` (``lm-eval[api]`` and ``transformers`` for the tokenizer; no torch).

By default it runs this repository's small task group ``td_smoke`` (``tests/data/lm_eval/``:
8 multiple-choice questions, 4 paragraphs for word perplexity, 4 short generated answers);
``--tasks`` takes any lm-eval task (those of lm-eval's own catalogue download their data sets
from the Hugging Face Hub). Prints the scores as JSON and writes lm-eval's output under
``--out``.

    python -m perf.lm_eval_run --url http://127.0.0.1:9000 [--model llm] [--tasks td_smoke]
                               [--tokenizer models/SmolLM2-135M-Instruct] [--out DIR] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import requests

from perf.lib.machine import ROOT
from perf.lib.results import results_dir
from perf.lib.tools import ensure_tool

LM_EVAL = "lm-eval[api]==0.4.13"
# the Hugging Face tokenizer backend; the project's version, so both count tokens the same way
LM_EVAL_EXTRA = ("transformers==5.24.0",)
TASKS_DIR = ROOT / "tests" / "data" / "lm_eval"
DEFAULT_TOKENIZER = ROOT / "models" / "SmolLM2-135M-Instruct"


def lm_eval_exe() -> Path:
    """The ``lm-eval`` command of the tool venv, installed on first use."""
    return ensure_tool("lm-eval", LM_EVAL, "lm-eval", LM_EVAL_EXTRA)


def served_model(url: str) -> str:
    """The first model the frontend at ``url`` lists."""
    return requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def run(
    url: str,
    out: Path,
    *,
    model: str | None = None,
    tokenizer: str | Path = DEFAULT_TOKENIZER,
    tasks: str = "td_smoke",
    include_path: str | Path | None = TASKS_DIR,
    limit: int | None = None,
    num_concurrent: int = 1,
    max_length: int = 2048,
    timeout_s: float = 1800,
) -> dict:
    """Run lm-eval against the OpenAI frontend at ``url`` (``http://host:port``); return the
    ``results`` of its output JSON (task -> metric -> value), with ``samples`` (task -> the
    logged samples) beside when lm-eval wrote them."""
    exe = lm_eval_exe()
    model = model or served_model(url)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model_args = ",".join(
        [
            f"model={model}",
            f"base_url={url}/v1/completions",
            f"tokenizer={tokenizer}",
            "tokenizer_backend=huggingface",
            f"num_concurrent={num_concurrent}",
            "max_retries=1",
            f"max_length={max_length}",
            "tokenized_requests=True",
        ]
    )
    cmd = [str(exe), "run", "--model", "local-completions", "--model_args", model_args, "--tasks", tasks]
    cmd += ["--output_path", str(out), "--log_samples", "--seed", "1234"]
    if include_path:
        cmd += ["--include_path", str(include_path)]
    if limit:
        cmd += ["--limit", str(limit)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("HF_DATASETS_CACHE", str(out / "hf-datasets-cache"))
    t0 = time.monotonic()
    with open(out / "lm_eval.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, cwd=ROOT)
    if proc.returncode != 0:
        tail = (out / "lm_eval.log").read_text()[-4000:]
        raise RuntimeError(f"lm-eval exited with {proc.returncode}: {' '.join(cmd)}\n{tail}")
    results_files = sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not results_files:
        raise RuntimeError(f"lm-eval wrote no results_*.json under {out}")
    data = json.loads(results_files[-1].read_text())
    samples = {}
    for f in results_files[-1].parent.glob("samples_*.jsonl"):
        task = f.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return {"results": data["results"], "samples": samples, "wall_s": round(time.monotonic() - t0, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the OpenAI frontend, http://HOST:PORT")
    p.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="Hugging Face tokenizer folder or name")
    p.add_argument("--tasks", default="td_smoke")
    p.add_argument("--include-path", default=str(TASKS_DIR), help="folder of extra task YAMLs ('' for none)")
    p.add_argument("--out", default=None, help="lm-eval's output folder (default: lm_eval/ in the results folder)")
    p.add_argument("--limit", type=int, default=None, help="at most this many documents per task")
    p.add_argument("--num-concurrent", type=int, default=1)
    p.add_argument("--max-length", type=int, default=2048, help="context length lm-eval assumes")
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else results_dir() / "lm_eval"
    res = run(
        args.url.rstrip("/"),
        out,
        model=args.model,
        tokenizer=args.tokenizer,
        tasks=args.tasks,
        include_path=args.include_path or None,
        limit=args.limit,
        num_concurrent=args.num_concurrent,
        max_length=args.max_length,
    )
    print(json.dumps({"results": res["results"], "wall_s": res["wall_s"], "out": str(out)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
