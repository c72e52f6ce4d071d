"""The real model checkpoint the tests run on, as ``build_scripts/prepare_model.py`` prepares it
(on first use): where that fails, the test skips with the reason, or fails in CI
(tests/skips.py). Light to import: a pytest run of its own can use it without torch."""

from __future__ import annotations

from pathlib import Path

from tests.skips import missing_setup


def real_model_dir() -> Path:
    """The prepared checkpoint's directory."""
    from build_scripts.prepare_model import ensure_model

    try:
        return ensure_model()
    except Exception as exc:  # whatever stops prepare stops the test, named
        missing_setup(f"the real model checkpoint cannot be prepared: {exc}")
