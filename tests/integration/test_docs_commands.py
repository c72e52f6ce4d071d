"""Every runnable command block of README.md and docs/*.md, run as a user would, from the
repository root, against one real deployment: the one the documentation's ``<!-- run:
deployment -->`` block starts (``triton-disagg serve --mode disagg ... --openai-port``), started
here in the background on free ports and stopped with Ctrl-C. A block fails the test when it
exits non-zero or prints nothing; blocks marked ``<!-- not run: why -->`` are not run (the
convention: ``tests/doc_blocks.py``; ``tests/unit/test_docs_lint.py`` checks the marks)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from backend.launch.ports import free_port
from tests.doc_blocks import ROOT, all_blocks, doc_files, with_ports

RUNNABLE = [b for b in all_blocks() if b.is_runnable]
START_TIMEOUT_S = 400
BLOCK_TIMEOUT_S = 180


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except Exception:
        return 0


@pytest.fixture(scope="module")
def deployment():
    """The documentation's deployment block, run in the background on free ports until every API
    answers; its ports (by :data:`tests.doc_blocks.DOC_PORTS` name). Stopped with Ctrl-C (a drain),
    then killed if it is still there a minute later."""
    (start,) = [b for b in all_blocks() if b.is_deployment]
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    command = with_ports(start.text, ports)
    proc = subprocess.Popen(
        ["bash", "-c", "exec " + command.strip()],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []

    def pump() -> None:  # a pipe nobody reads fills and blocks serve
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (
            any("Ctrl-C stops" in line for line in lines)
            and _get(f"http://127.0.0.1:{ports['http']}/v2/health/ready") == 200
            and _get(f"http://127.0.0.1:{ports['openai']}/health") == 200
        ):
            assert proc.poll() is None, f"{start.where}: serve exited early:\n" + "".join(lines[-80:])
            assert time.monotonic() < deadline, f"{start.where}: not serving within {START_TIMEOUT_S} s:\n" + "".join(
                lines[-80:]
            )
            time.sleep(1)
        print(f"{start.where}: serving on {ports}")
        yield ports
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: serve drains and stops what it started
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        print("".join(lines[-20:]))


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_runnable_block(block, deployment):
    text = with_ports(block.text, deployment)
    missing = [tool for tool in ("curl",) if re.search(rf"\b{tool}\b", text) and shutil.which(tool) is None]
    assert not missing, f"{block.where} needs {missing}, which this machine lacks (a user's machine has them)"
    argv = [sys.executable, "-c", text] if block.lang == "python" else ["bash", "-euo", "pipefail", "-c", text]
    t0 = time.monotonic()
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    print(f"{block.where}: exit {out.returncode} in {time.monotonic() - t0:.1f} s\n{out.stdout[-2000:]}")
    assert out.returncode == 0, f"{block.where} failed (exit {out.returncode}):\n{text}\n{out.stdout}\n{out.stderr}"
    assert out.stdout.strip(), f"{block.where} printed nothing:\n{text}\n{out.stderr}"


def test_every_bench_subcommand_named_exists():
    """The subcommands the pages name (``bench NAME``) are those ``triton-disagg bench --help`` lists."""
    out = subprocess.run(
        [str(Path(sys.executable).parent / "triton-disagg"), "bench", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    listed = set(re.findall(r"^  ([a-z0-9-]+)\s", out.stdout, re.M))
    named = {m for path in doc_files() for m in re.findall(r"\bbench ([a-z][a-z0-9-]+)", path.read_text())}
    assert not named - listed, f"bench subcommands the docs name that `bench --help` does not list: {named - listed}"
