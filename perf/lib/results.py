"""The one results envelope every benchmark run is recorded in, and where results live.

A benchmark writes its own files (JSON figures, a markdown table, plots) under
``results_dir()`` (``perf/results/``, not tracked; ``TRITON_DISAGG_RESULTS`` moves it). Each
``triton-disagg bench`` run is then recorded in one envelope under ``runs_dir()``
(``perf/runs/``, tracked: the report is generated from it)::

    {"schema": 2, "benchmark": "engine", "command": ["triton-disagg", "bench", "engine", ...],
     "commit": "<sha>[+dirty]", "machine": {cpu, cpu_id, cores, memory_gib, torch, gpu, ...},
     "started": ISO time, "seconds": wall time, "exit_code": 0,
     "files": [the result files the run wrote],
     "figures": {file: its JSON, without the parts too large to keep (per-request records)},
     "markdown": {file: the markdown table it wrote},
     "output": the tail of what it printed}

``figures`` holds what the benchmark reports in its own terms. ``latest(benchmark)`` is the
newest envelope of a benchmark; ``latest(benchmark, ok=True)`` the newest that exited 0.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from perf.lib.machine import ROOT, commit, describe

SCHEMA = 2
RESULTS_ENV = "TRITON_DISAGG_RESULTS"  # the raw results folder (and, when set, the envelopes under it)
RUNS_ENV = "TRITON_DISAGG_RUNS"  # the envelopes' folder
KEEP_BYTES = 64 << 10  # a figure (a JSON value) or a markdown file larger than this stays in its file only
RESULT_SUFFIXES = (".json", ".md", ".png", ".csv", ".jsonl")


def results_dir() -> Path:
    """Where benchmarks write their files: ``$TRITON_DISAGG_RESULTS`` or ``perf/results/``."""
    path = Path(os.environ.get(RESULTS_ENV) or ROOT / "perf" / "results")
    path.mkdir(parents=True, exist_ok=True)
    return path


def runs_dir() -> Path:
    """Where envelopes are kept: ``$TRITON_DISAGG_RUNS``; else ``runs/`` inside a results folder
    set by ``$TRITON_DISAGG_RESULTS``; else ``perf/runs/`` (tracked)."""
    if os.environ.get(RUNS_ENV):
        return Path(os.environ[RUNS_ENV])
    if os.environ.get(RESULTS_ENV):
        return Path(os.environ[RESULTS_ENV]) / "runs"
    return ROOT / "perf" / "runs"


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
    markdown: dict = field(default_factory=dict)
    output: str = ""
    schema: int = SCHEMA


_running: list[Run] = []  # the run being recorded in this process (``begin`` .. ``finish``)


def begin(benchmark: str, command: list[str]) -> Run:
    run = Run(benchmark, list(command), commit(), describe(), time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    _running[:] = [run]
    return run


def command_line(module: str) -> str:
    """The command that reproduces this run, for a benchmark's own report: the recorded
    ``triton-disagg bench ...`` one, or ``python -m <module> ...`` when run directly."""
    if _running:
        return shlex.join(_running[0].command)
    return shlex.join(["python", "-m", module, *sys.argv[1:]])


def file_states(root: Path) -> dict[Path, tuple[int, int]]:
    """Each result file under ``root`` (envelopes aside) with its modification time and size:
    taken before a run, so that what the run wrote is what changed (a file's modification time
    comes from the kernel's coarse clock and can read earlier than ``time.time()`` taken just
    before the write, so comparing with a start time misses files written at once)."""
    if not root.exists():
        return {}
    out = {}
    for p in root.rglob("*"):
        if p.suffix in RESULT_SUFFIXES and p.parent.name != "runs":
            try:
                st = p.stat()
            except OSError:
                continue
            if p.is_file():
                out[p] = (st.st_mtime_ns, st.st_size)
    return out


def files_written(before: dict[Path, tuple[int, int]], root: Path) -> list[Path]:
    """Result files under ``root`` that are new or changed since ``before`` (``file_states``)."""
    return sorted(p for p, state in file_states(root).items() if before.get(p) != state)


def _size(value) -> int:
    return len(json.dumps(value, default=str))


def keepable(figures):
    """``figures`` without the values too large for an envelope (per-request records, traces):
    a large dict keeps its small keys, recursively; any other large value is dropped."""
    if _size(figures) <= KEEP_BYTES:
        return figures
    if isinstance(figures, dict):
        kept = {k: keepable(v) for k, v in figures.items()}
        return {k: v for k, v in kept.items() if v is not None}
    return None


def finish(
    run: Run, since: float, exit_code: int, before: dict[Path, tuple[int, int]], results_root: Path | None = None
) -> Path:
    """Complete ``run`` (started at ``since``, the result files then as ``before``) with its
    time, exit code and the files it wrote (their figures and markdown); save it under
    ``runs_dir()``; its path."""
    root = results_dir() if results_root is None else results_root
    _running.clear()
    run.seconds = round(time.time() - since, 3)
    run.exit_code = exit_code
    written = files_written(before, root)
    run.files = [str(p.relative_to(ROOT)) if ROOT in p.parents else str(p) for p in written]
    for p, name in zip(written, run.files):
        if p.suffix == ".json" and p.stat().st_size < 64 << 20:
            try:
                kept = keepable(json.loads(p.read_text()))
            except ValueError:
                continue
            if kept is not None:
                run.figures[name] = kept
        elif p.suffix == ".md" and p.stat().st_size <= KEEP_BYTES:
            run.markdown[name] = p.read_text()
    out_dir = runs_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{run.benchmark}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(since))}"
    path, n = out_dir / f"{stem}.json", 1
    while path.exists():  # another run of it started in the same second
        n += 1
        path = out_dir / f"{stem}-{n}.json"
    path.write_text(json.dumps(asdict(run), indent=1, default=str) + "\n")
    return path


_STAMP = re.compile(r"(\d{8}-\d{6})(?:-(\d+))?$")  # <benchmark>-<start stamp>[-<n>]


def envelopes(benchmark: str, runs: Path | None = None) -> list[dict]:
    """Every envelope of ``benchmark``, oldest first."""
    out_dir = runs_dir() if runs is None else runs
    found = list(out_dir.glob(f"{benchmark}-[0-9]*.json")) if out_dir.exists() else []
    return [json.loads(p.read_text()) for p in sorted(found, key=_started_order)]


def _started_order(path: Path) -> tuple[str, int]:
    """An envelope's place in time: its start stamp, then its number within that second."""
    m = _STAMP.search(path.stem)
    return (m[1], int(m[2] or 1)) if m else (path.stem, 0)


def latest(benchmark: str, runs: Path | None = None, ok: bool = False) -> dict | None:
    """The newest envelope of ``benchmark`` (None if it never ran); ``ok``: of a run that exited 0."""
    found = [e for e in envelopes(benchmark, runs) if not ok or e.get("exit_code") == 0]
    return found[-1] if found else None
