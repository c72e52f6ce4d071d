"""lm-evaluation-harness against a running OpenAI frontend (``local-completions``: token-id
prompts, ``echo`` + ``logprobs`` for the loglikelihood tasks, greedy generation for the
``generate_until`` ones). lm-eval installs on first use into its own venv,
``.venv/tools/lm-eval`` (``lm-eval[api]`` and ``transformers`` for the tokenizer; no torch).

By default it runs this repository's small task group ``td_smoke`` (``tests/data/lm_eval/``:
8 multiple-choice questions, 4 paragraphs for word perplexity, 4 short generated answers);
``--tasks`` takes any lm-eval task (those of lm-eval's own catalogue download their data sets
from the Hugging Face Hub).

Without ``--url`` it starts each deployment of ``--modes`` itself (``perf/lib/servers.py``, the
OpenAI frontend in front; the disaggregated one with ``--disagg-chunk``-token prefill chunks, so
the prompts cross chunk boundaries and the KV transfer), runs the tasks on each into
``--out``/<mode>/, and prints the scores side by side with whether every loglikelihood (within
1e-3 nats) and every generated text agree across the modes (``summary.{json,md}``). With
``--url`` it runs once against that frontend into ``--out`` and prints the scores as JSON.

    python -m perf.lm_eval_run [--modes aggregated,disagg] [--url http://127.0.0.1:9000]
        [--model llm] [--tasks td_smoke] [--tokenizer models/SmolLM2-135M-Instruct] [--out DIR]
        [--limit N]
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


LL_ATOL = 1e-3  # nats: two modes' loglikelihoods of one request agree within this
# the figures of the side-by-side table: column title -> "task/lm-eval metric"
COLUMNS = {
    "td_mc acc": "td_mc/acc,none",
    "acc_norm": "td_mc/acc_norm,none",
    "td_ppl word perplexity": "td_ppl/word_perplexity,none",
    "byte perplexity": "td_ppl/byte_perplexity,none",
    "bits/byte": "td_ppl/bits_per_byte,none",
    "td_gen exact_match": "td_gen/exact_match,strip",
}


def _responses(samples: list[dict]) -> list:
    """Each logged sample's responses in document order: loglikelihoods or generated texts."""
    ordered = sorted(samples, key=lambda s: (s["doc_id"], str(s.get("arguments"))))
    return [s.get("filtered_resps", s.get("resps")) for s in ordered]


def _close(a, b) -> bool:
    """Responses agree: numbers (or numeric strings) within ``LL_ATOL``, everything else equal."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    x, y = _float(a), _float(b)
    if x is not None and y is not None:
        return abs(x - y) <= LL_ATOL
    return a == b


def _float(v) -> float | None:
    """A logged number (lm-eval logs loglikelihoods as strings), or None."""
    if isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def agreement(by_mode: dict[str, dict]) -> dict[str, bool]:
    """task -> whether every mode's logged responses equal the first mode's (loglikelihoods
    within ``LL_ATOL``), for the tasks every mode logged."""
    runs = [r["samples"] for r in by_mode.values() if "samples" in r]
    if len(runs) < 2:
        return {}
    tasks = set.intersection(*(set(s) for s in runs))
    return {t: all(_close(_responses(runs[0][t]), _responses(s[t])) for s in runs[1:]) for t in sorted(tasks)}


def table(by_mode: dict[str, dict]) -> str:
    """The scores of each mode as a markdown table (an error row for a mode that failed)."""
    rows = ["| mode | " + " | ".join(COLUMNS) + " | wall (s) |", "|---" * (len(COLUMNS) + 2) + "|"]
    for mode, r in by_mode.items():
        if "error" in r:
            rows.append(f"| {mode} | " + " | ".join(["-"] * len(COLUMNS)) + f" | {r['error'][:120]} |")
            continue
        cells = [r["results"].get(task, {}).get(metric) for task, metric in (c.split("/") for c in COLUMNS.values())]
        shown = " | ".join("-" if v is None else f"{v:.4g}" for v in cells)
        rows.append(f"| {mode} | {shown} | {r['wall_s']} |")
    return "\n".join(rows)


def _options(args) -> dict:
    """``run``'s keyword arguments from the command line."""
    return dict(
        model=args.model,
        tokenizer=args.tokenizer,
        tasks=args.tasks,
        include_path=args.include_path or None,
        limit=args.limit,
        num_concurrent=args.num_concurrent,
        max_length=args.max_length,
    )


def run_modes(args, out: Path) -> int:
    """Start each deployment of ``args.modes`` with the OpenAI frontend, run lm-eval on it, stop
    it; write and print the side-by-side summary. 0 when every mode ran."""
    from perf.lib import servers

    lm_eval_exe()  # the install on first use, before any server starts
    by_mode: dict[str, dict] = {}
    for mode in args.modes.split(","):
        overrides = {"max_num_batched_tokens": str(args.disagg_chunk)} if mode == "disagg" else {}
        try:
            with servers.started_with_openai(mode, out / f"logs-{mode}", overrides=overrides) as (_, frontend):
                by_mode[mode] = run(frontend.url, out / mode, **dict(_options(args), model=frontend.served_model_name))
        except Exception as exc:  # the exact error in the summary; the next mode still runs
            by_mode[mode] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{mode}: {json.dumps(by_mode[mode].get('results', by_mode[mode]))}", flush=True)
    agree = agreement(by_mode)
    settings = {"tasks": args.tasks, "limit": args.limit, "disagg_chunk": args.disagg_chunk}
    summary = {
        "settings": settings,
        "results": {m: {k: r[k] for k in ("results", "wall_s", "error") if k in r} for m, r in by_mode.items()},
        "responses_agree_across_modes": agree,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    agrees = ", ".join(f"{t}: {'yes' if ok else 'NO'}" for t, ok in agree.items()) or "-"
    title = f"lm-eval {LM_EVAL.split('==')[1]}, settings {settings}"
    md = f"{title}\n\n{table(by_mode)}\n\nresponses agree across modes: {agrees}\n"
    (out / "summary.md").write_text(md)
    print(md)
    return 0 if all("error" not in r for r in by_mode.values()) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running OpenAI frontend, http://HOST:PORT (default: start --modes)")
    p.add_argument("--modes", default="aggregated,disagg", help="deployments to start when no --url")
    p.add_argument("--disagg-chunk", type=int, default=32, help="the disaggregated deployment's prefill chunk (tokens)")
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
    if args.url is None:
        return run_modes(args, out)
    res = run(args.url.rstrip("/"), out, **_options(args))
    print(json.dumps({"results": res["results"], "wall_s": res["wall_s"], "out": str(out)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
