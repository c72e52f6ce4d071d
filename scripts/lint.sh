#!/usr/bin/env bash
# Lint: ruff (rules and format), the import-linter contracts of the layering and mypy (config in pyproject.toml).
# Needs the venv from scripts/setup.sh.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports
.venv/bin/mypy
