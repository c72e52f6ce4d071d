"""Unit tests run without NIXL.

* Importing ``nixl_cu12`` / ``nixl_cu13`` raises ImportError while the unit test modules are
  collected (so every module they import must import without NIXL) and while each unit test
  runs: a ``sys.meta_path`` finder, installed only around those steps so that integration tests
  in the same session keep real NIXL; a NIXL they already loaded is hidden from ``sys.modules``
  meanwhile.
* Every unit test gets the in-process fake (``tests/fake_nixl.py``) installed as NIXL for every
  ``FabricAgent`` created anywhere (``fabric_bridge.nixl_api.install``), with a fresh fabric;
  the ``fabric`` fixture is its control panel (``fake_nixl.FABRIC``).

Tests that need real NIXL live in ``tests/integration/``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from importlib.abc import MetaPathFinder

import fake_nixl
import pytest

from fabric_bridge import nixl_api

BLOCKED = ("nixl_cu12", "nixl_cu13")


class _NoNixl(MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname.partition(".")[0] in BLOCKED:
            raise ImportError(f"{fullname} is blocked in unit tests: they run on tests/fake_nixl.py")
        return None


_BLOCKER = _NoNixl()


def _block() -> dict:
    """Install the blocker; hide (and return) any NIXL module already loaded."""
    hidden = {k: sys.modules.pop(k) for k in list(sys.modules) if k.partition(".")[0] in BLOCKED}
    if _BLOCKER not in sys.meta_path:
        sys.meta_path.insert(0, _BLOCKER)
    return hidden


def _unblock(hidden: dict) -> None:
    if _BLOCKER in sys.meta_path:
        sys.meta_path.remove(_BLOCKER)
    sys.modules.update(hidden)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """Collect (import) the unit test modules with NIXL blocked; only nodes under tests/unit
    reach this hook, so integration modules of the same session import real NIXL as usual."""
    hidden = _block()
    try:
        return (yield)
    finally:
        _unblock(hidden)


@pytest.fixture(autouse=True)
def fabric() -> Iterator[fake_nixl.Fabric]:
    hidden = _block()
    previous = nixl_api.install(fake_nixl)
    fake_nixl.FABRIC.reset()
    try:
        yield fake_nixl.FABRIC
    finally:
        nixl_api.install(previous)
        fake_nixl.FABRIC.reset()
        _unblock(hidden)


@pytest.fixture(params=["avx2", "avx512_vnni"])
def kernels(request, monkeypatch):
    """The group kernel's version for the test: ``avx2`` (forced, runs on any CPU the format runs
    on) or ``avx512_vnni`` (the default where the CPU has it; skipped, with the reason, where not)."""
    from backend.engine import cpu_kernels, group_matmul

    if request.param == "avx512_vnni":
        missing = cpu_kernels.missing_flags(cpu_kernels.GROUP_VNNI_FLAGS)
        if missing:
            pytest.skip(reason=f"the AVX-512 VNNI kernel needs {', '.join(missing)}, which this CPU lacks")
        monkeypatch.setenv("TRITON_DISAGG_KERNELS", "auto")
    else:
        monkeypatch.setenv("TRITON_DISAGG_KERNELS", "avx2")
    group_matmul.kernel.cache_clear()
    assert group_matmul.kernel() == group_matmul.KERNELS[request.param]
    print(f"int4w kernel: {request.param}")
    yield request.param
    group_matmul.kernel.cache_clear()
