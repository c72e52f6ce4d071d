"""``triton-disagg bench`` as a user runs it, in a process of its own (perf/ is never imported by
the tests: the import-linter contracts in pyproject.toml): the help lists the benchmarks, an
unknown one is refused by name, a help text is not a recorded run, a failed run is recorded with
its command and exit code, and ``bench report`` makes the committed perf/REPORT.md out of the
committed run envelopes (perf/runs/). Each benchmark on a tiny setting, and the envelope of a run
that succeeds: tests/integration/test_bench_subcommands.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "backend.cli", "bench", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def test_help_lists_the_benchmarks_and_the_report():
    r = bench("--help")
    assert r.returncode == 0, r.stderr
    for name in ("engine", "serve", "transfer", "sweep", "multiturn", "cpp-baseline", "genai-perf", "autoscale"):
        assert f"\n  {name} " in r.stdout, name
    assert "\n  report " in r.stdout
    for investigation in ("group-kernels", "disk-tier", "local-prefill"):  # perf/history/experiments.md
        assert f"\n  {investigation} " not in r.stdout, investigation


def test_an_unknown_subcommand_is_refused_by_name():
    r = bench("no-such-bench")
    assert r.returncode != 0 and "no-such-bench" in r.stderr


def test_a_help_text_is_not_a_run_and_a_failed_run_is_recorded(tmp_path):
    runs = tmp_path / "runs"
    env = {"TRITON_DISAGG_RESULTS": str(tmp_path / "results"), "TRITON_DISAGG_RUNS": str(runs)}
    r = bench("plan-check", "--help", env=env)
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr
    assert not list(runs.glob("*.json"))
    r = bench("plan-check", "--no-such-flag", env=env)
    assert r.returncode == 2, r.stderr
    (path,) = runs.glob("*.json")
    run = json.loads(path.read_text())
    assert run["command"] == ["triton-disagg", "bench", "plan-check", "--no-such-flag"]
    assert run["exit_code"] == 2 and run["files"] == []
    assert len(run["commit"]) >= 40 or run["commit"] == "unknown"
    assert run["machine"]["cores"] >= 1 and run["machine"]["cpu"]
    assert "run recorded in" in r.stderr


def test_the_committed_report_is_what_bench_report_makes_of_the_committed_runs(tmp_path):
    out = tmp_path / "REPORT.md"
    r = bench("report", "--out", str(out))
    assert r.returncode == 0, r.stderr
    # the one link into perf/history/ is relative to where the report is written
    made = re.sub(r"\]\([^)]*?history/", "](history/", out.read_text())
    assert made == (ROOT / "perf" / "REPORT.md").read_text(), (
        "perf/REPORT.md is stale: run `triton-disagg bench report`"
    )
