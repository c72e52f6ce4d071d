"""Locate the real Triton Inference Server shipped in the ``nvidia-pytriton`` wheel.

The wheel carries ``tritonserver`` with the Python backend, and a Python-backend stub per
Python version. Triton looks for the stub next to ``libtriton_python.so``; we copy it there
once (pytriton does the same at run time). The stub links ``libpython3.X.so`` by name, so
the server must run with the venv interpreter's LIBDIR first on ``LD_LIBRARY_PATH`` and the
venv's ``bin/`` first on ``PATH`` (verified with the versions pinned in ``pyproject.toml``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TritonInstall:
    root: Path

    @property
    def server_bin(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def backend_dir(self) -> Path:
        return self.root / "backends"

    @property
    def stub(self) -> Path:
        return self.backend_dir / "python" / "triton_python_backend_stub"

    def server_env(self, base: dict | None = None) -> dict:
        """Environment for ``tritonserver`` so the stub loads this venv's libpython and packages."""
        env = dict(os.environ if base is None else base)
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
        env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        repo_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
        return env


def find_triton() -> TritonInstall:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("nvidia-pytriton is not installed; run scripts/setup.sh")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    inst = TritonInstall(root)
    if not inst.server_bin.is_file():
        raise FileNotFoundError(f"tritonserver binary not found at {inst.server_bin}")
    return inst


def install_stub() -> TritonInstall:
    """Copy the Python-backend stub for this interpreter's version next to the backend (idempotent)."""
    inst = find_triton()
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    src = inst.root / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not src.is_file():
        raise FileNotFoundError(f"no Python-backend stub for Python {ver} in {src.parent.parent}")
    if not inst.stub.is_file() or inst.stub.stat().st_size != src.stat().st_size:
        shutil.copy2(src, inst.stub)
    inst.stub.chmod(0o755)
    return inst


if __name__ == "__main__":
    print(install_stub().root)
