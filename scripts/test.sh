#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/python -m build_scripts.prepare_model >/dev/null
exec .venv/bin/python -m pytest -q "$@"
