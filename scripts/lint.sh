#!/usr/bin/env bash
# Lint: ruff (rules and format), the import-linter contracts of the layering, mypy (config in pyproject.toml)
# and promtool on the Prometheus rules.
# Needs the venv from scripts/setup.sh.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports
.venv/bin/mypy
# the Prometheus rules that `serve --prometheus` loads (promtool comes with Debian's prometheus)
if command -v promtool >/dev/null 2>&1; then
  promtool check rules deploy/prometheus/triton-disagg-rules.yml >/dev/null
else
  echo "[lint] promtool not installed (scripts/setup.sh installs Debian's prometheus): the rules are not checked" >&2
fi
