"""The run's skip policy (tests/skips.py, hooked in tests/conftest.py), shown on pytest runs of
their own: a CI run fails on a skip off the allowlist and passes on one on it, each skip is
listed with its reason, and a broken ``prepare`` or a missing pinned dependency fails a CI run
instead of skipping."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.skips import allowed

REPO = Path(__file__).resolve().parents[2]

SKIPPING = """
import pytest

def test_a_cpu_feature():
    pytest.skip(reason="the example kernel needs avx512_vnni, which this CPU lacks")

def test_a_missing_tool():
    pytest.skip(reason="a tool is not around")
"""

MISSING_SETUP = """
from tests.checkpoint import real_model_dir
from tests.skips import require_module

def test_through_the_fixture(model_dir):
    assert model_dir.is_dir()

def test_through_the_helper():
    assert real_model_dir().is_dir()

def test_a_missing_pinned_dependency():
    require_module("no_such_pinned_module", "a pinned dependency")
"""

# loaded first (``-p``): build_scripts/prepare_model.py finds no checkpoint where it looks and
# no packaged GGUF to make one from
BREAK_PREPARE = """
from pathlib import Path

import build_scripts.prepare_model as prepare

prepare.DEFAULT_MODEL_DIR = Path(__file__).parent / "no-checkpoint"
prepare.GGUF_PACKAGE = "no_such_gguf_package"
"""


def run_pytest(tmp_path: Path, files: dict[str, str], *args: str, ci: bool) -> subprocess.CompletedProcess:
    """pytest on ``files`` (written to ``tmp_path``) with the suite's hooks (tests/conftest.py),
    under ``CI=true`` or with no ``CI``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"PYTHONPATH": str(REPO)}
    if ci:
        env["CI"] = "true"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


BROKEN = {"test_missing_setup.py": MISSING_SETUP, "break_prepare.py": BREAK_PREPARE}
RUNS = {  # name -> (files, arguments, CI)
    "off-list, ci": ({"test_skipping.py": SKIPPING}, ("test_skipping.py",), True),
    "off-list": ({"test_skipping.py": SKIPPING}, ("test_skipping.py",), False),
    "allowed only, ci": ({"test_skipping.py": SKIPPING}, ("test_skipping.py", "-k", "cpu_feature"), True),
    "broken setup, ci": (BROKEN, ("-p", "break_prepare", "test_missing_setup.py"), True),
    "broken setup": (BROKEN, ("-p", "break_prepare", "test_missing_setup.py"), False),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each of :data:`RUNS`, run at once (each pytest process spends seconds importing the
    suite's hooks: in turn they took 25 s of the unit tests)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> subprocess.CompletedProcess:
        files, args, ci = RUNS[name]
        return run_pytest(tmp_path_factory.mktemp("run"), files, *args, ci=ci)

    with ThreadPoolExecutor(len(RUNS)) as pool:
        return dict(zip(RUNS, pool.map(one, RUNS)))


def test_the_allowlist_takes_what_this_machine_cannot_have_only():
    assert allowed("the AVX-512 VNNI kernel needs avx512_vnni, which this CPU lacks")
    assert allowed("NIXL (nixl-cu12) is not installed") is None
    assert allowed("the real model checkpoint cannot be prepared: no such file") is None


@pytest.mark.parametrize("ci", [True, False])
def test_a_skip_off_the_allowlist_fails_a_ci_run_only_and_every_skip_is_listed(runs, ci):
    run = runs["off-list, ci" if ci else "off-list"]
    out = run.stdout + run.stderr
    assert run.returncode == (1 if ci else 0), out
    assert "test_skipping.py::test_a_cpu_feature: the example kernel needs avx512_vnni" in out, out
    assert "[allowed: a CPU feature this machine cannot have" in out, out
    assert "test_skipping.py::test_a_missing_tool: a tool is not around  [NOT ALLOWED]" in out, out
    verdict = "this CI run fails" if ci else "a CI run would fail"
    assert f"2 skipped, 1 not allowed: {verdict}" in out, out


def test_a_ci_run_with_allowed_skips_only_passes(runs):
    run = runs["allowed only, ci"]
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "1 skipped, 0 not allowed: all allowed" in out, out


@pytest.mark.parametrize("ci", [True, False])
def test_a_broken_prepare_or_a_missing_dependency_fails_a_ci_run_and_skips_elsewhere(runs, ci):
    run = runs["broken setup, ci" if ci else "broken setup"]
    out = run.stdout + run.stderr
    assert "package 'no_such_gguf_package' is not installed" in out, out
    assert "the real model checkpoint cannot be prepared" in out, out
    assert "a pinned dependency is not installed (No module named 'no_such_pinned_module')" in out, out
    if ci:  # the helper's test and the dependency's fail, the fixture's errs at its set-up
        assert run.returncode == 1 and "2 failed, 1 error" in out and "skipped" not in out, out
    else:  # skipped, each named, and a CI run would fail
        assert run.returncode == 0 and "3 skipped, 3 not allowed: a CI run would fail" in out, out
