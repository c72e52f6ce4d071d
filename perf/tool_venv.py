"""A private virtual environment per external benchmark tool (genai-perf, AIPerf) under
``.venv/tools/<name>``: their pinned dependencies differ from the project's, so they never
share its ``.venv``. Created on first use from the package registry; later calls reuse it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ensure_tool(name: str, requirement: str, executable: str, extra: tuple[str, ...] = ()) -> Path:
    """The path of ``executable`` in the tool's venv, installing ``requirement`` (and the
    requirements in ``extra``, in the same pip run) if needed."""
    venv = ROOT / ".venv" / "tools" / name
    exe = venv / "bin" / executable
    stamp = venv / ".requirement"
    wanted = " ".join((requirement, *extra))
    if exe.is_file() and stamp.is_file() and stamp.read_text() == wanted:
        return exe
    if not (venv / "bin" / "python").is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    print(f"[{name}] installing {wanted} into {venv} ...", flush=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, requirement, *extra], check=True)
    stamp.write_text(wanted)
    return exe
