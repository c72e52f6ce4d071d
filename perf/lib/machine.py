"""The machine and the code a figure was measured on: CPU model and kernel path, cores, memory,
torch version, GPU (if torch sees one) and the git commit (with a mark when the tree had changes)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from backend.engine.cpu_kernels import cpu_id, cpu_model, kernel_path
from backend.engine.formats import choose_weights_format, kernel_path_line

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """``git describe``-like: the commit hash, ``+dirty`` when tracked files changed."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def describe() -> dict:
    """Everything a result records about where it ran."""
    import torch

    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpu_model(),
        "cpu_id": cpu_id(),
        "kernel_path": kernel_path().as_dict(),
        "kernel_path_line": kernel_path_line(),  # as the server's log and the test run's header print it
        # what serve's default weights_dtype (auto) resolves to here, and why
        "weights_auto": dict(zip(("format", "why"), choose_weights_format("float32", "cpu", 1))),
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": mem_gib,
        "torch": torch.__version__,
        "gpu": gpu,
        "python": platform.python_version(),
        "host": platform.node(),
    }
