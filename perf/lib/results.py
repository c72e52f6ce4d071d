"""The one results envelope every benchmark run is recorded in, and where results live.

``perf/results/runs/<benchmark>-<stamp>.json``::

    {"schema": 1, "benchmark": "engine", "command": ["triton-disagg", "bench", "engine", ...],
     "commit": "<sha>[+dirty]", "machine": {cpu, cpu_id, cores, memory_gib, torch, gpu, ...},
     "started": ISO time, "seconds": wall time, "exit_code": 0,
     "files": [the result files the run wrote under perf/results/], "figures": {...}}

``figures`` holds what the benchmark reports in its own terms (its JSON output when it wrote
one). ``latest(benchmark)`` is the newest envelope of a benchmark.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from perf.lib.machine import ROOT, commit, describe

RESULTS = ROOT / "perf" / "results"
SCHEMA = 1


@dataclass
class Run:
    benchmark: str
    command: list[str]
    commit: str
    machine: dict
    started: str
    seconds: float = 0.0
    exit_code: int | None = None
    files: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    schema: int = SCHEMA


def begin(benchmark: str, command: list[str]) -> Run:
    return Run(benchmark, list(command), commit(), describe(), time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def files_since(since: float, root: Path | None = None) -> list[Path]:
    """Result files (JSON, markdown, plots) written under ``root`` (the results folder) since
    ``since``, envelopes aside."""
    root = RESULTS if root is None else root
    if not root.exists():
        return []
    out = []
    for p in root.rglob("*"):
        if p.is_file() and p.suffix in (".json", ".md", ".png", ".csv", ".jsonl") and root / "runs" not in p.parents:
            try:
                if p.stat().st_mtime >= since:
                    out.append(p)
            except OSError:
                continue
    return sorted(out)


def finish(run: Run, since: float, exit_code: int, results_dir: Path | None = None) -> Path:
    """Complete ``run`` with its time, exit code and the files it wrote; save it under the
    results folder's ``runs/``; its path."""
    results_dir = RESULTS if results_dir is None else results_dir
    out_dir = results_dir / "runs"
    run.seconds = round(time.time() - since, 3)
    run.exit_code = exit_code
    written = files_since(since, results_dir)
    run.files = [str(p.relative_to(ROOT)) if ROOT in p.parents else str(p) for p in written]
    for p, name in zip(written, run.files):
        if p.suffix == ".json" and p.stat().st_size < 4 << 20:
            try:
                run.figures[name] = json.loads(p.read_text())
            except ValueError:
                continue
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{run.benchmark}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(since))}.json"
    path.write_text(json.dumps(asdict(run), indent=1, default=str))
    return path


def latest(benchmark: str, results_dir: Path | None = None) -> dict | None:
    """The newest envelope of ``benchmark`` (None if it never ran)."""
    out_dir = (RESULTS if results_dir is None else results_dir) / "runs"
    found = sorted(out_dir.glob(f"{benchmark}-*.json")) if out_dir.exists() else []
    return json.loads(found[-1].read_text()) if found else None
