#!/usr/bin/env bash
# Set everything up (idempotent), prepare the model, serve it on a real Triton server and
# answer a sample prompt through it. Pass "serve" to keep serving until Ctrl-C instead.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
export HF_HUB_OFFLINE=1
exec .venv/bin/triton-disagg "${1:-demo}" "${@:2}"
