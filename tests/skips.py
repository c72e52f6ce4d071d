"""The test run's skips: the short list of reasons a CI run may skip for, each with why; what a
test does when a part of the setup is missing (it skips naming it, and fails in CI); and the
record of one run's skips, printed at its end, that fails a CI run holding a skip off the list.

A CI run is one with ``CI`` set to true (``.ci/run`` and ``scripts/test.sh`` set it): there the
setup is complete, so a missing pinned dependency, tool or prepared checkpoint is a failure, and
a skip is allowed only for what the machine cannot have."""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import NoReturn

import pytest

# reason pattern (searched in the skip's reason) -> why a CI run may skip for it
ALLOWED = {
    r"which this CPU lacks": "a CPU feature this machine cannot have (AVX-512 VNNI, AVX512-BF16 or AMX-BF16); "
    "the kernels this CPU runs are tested",
    r"needs a GPU": "GPU-only; this machine has none",
}


def in_ci() -> bool:
    """``CI`` is true (or 1 / yes): a missing part of the setup fails, and so does a skip off :data:`ALLOWED`."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def allowed(reason: str) -> str | None:
    """Why :data:`ALLOWED` lets a run skip for ``reason``, or None."""
    return next((why for pattern, why in ALLOWED.items() if re.search(pattern, reason)), None)


def missing_setup(what: str) -> NoReturn:
    """``what`` (a pinned dependency, a tool ``scripts/setup.sh`` installs, the prepared checkpoint)
    is missing: the test skips naming it, or in CI fails."""
    if in_ci():
        pytest.fail(f"{what} (CI: the setup provides it, so its absence fails)", pytrace=False)
    pytest.skip(reason=f"{what} (scripts/setup.sh provides it)")


def require_module(name: str, what: str) -> ModuleType:
    """Module ``name`` of the pinned dependency ``what``; missing, :func:`missing_setup`."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing_setup(f"{what} is not installed ({exc})")


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason of a skipped report (the project has no expected failures: one would show its
    error here, which no allowlist entry names, and so fail a CI run)."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@dataclass
class SkipRecord:
    """The skips of one run, as (test or module id, reason)."""

    skips: list[tuple[str, str]] = field(default_factory=list)

    def add(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if report.skipped:
            self.skips.append((report.nodeid, skip_reason(report)))

    def unlisted(self) -> list[tuple[str, str]]:
        return [(node, reason) for node, reason in self.skips if allowed(reason) is None]

    def fails_run(self) -> bool:
        """A CI run with a skip off :data:`ALLOWED`."""
        return in_ci() and bool(self.unlisted())

    def write(self, terminal) -> None:
        """A section listing each skip with its reason and why it is allowed, or that it is not."""
        if not self.skips:
            return
        terminal.section("skips (a CI run allows those of tests/skips.py ALLOWED only)")
        for node, reason in self.skips:
            why = allowed(reason)
            terminal.write_line(f"{node}: {reason}  [{f'allowed: {why}' if why else 'NOT ALLOWED'}]")
        unlisted = len(self.unlisted())
        verdict = "this CI run fails" if self.fails_run() else "a CI run would fail" if unlisted else "all allowed"
        terminal.write_line(f"{len(self.skips)} skipped, {unlisted} not allowed: {verdict}")
