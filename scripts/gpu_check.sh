#!/usr/bin/env bash
# The one GPU check (perf/gpu_check.py): the engine on the device against transformers, two
# processes moving KV over NIXL with bytes compared, and absolute figures for a 1B Llama shape.
# Written for the GPU machine the project borrows (one H200, Python 3.12 with a CUDA torch and
# transformers, no tritonserver, no NIXL, no network): at most 8 minutes.
#
#   bash scripts/gpu_check.sh --out DIR [--device cuda|cpu] [--quick] [--nixl-wheel FILE]
#
# --nixl-wheel: a NIXL wheel carried to the machine (e.g. nixl_cu13-1.5.1-cp312-...whl, 56 MiB),
# installed without network into a private folder for this run; without it the transfer parts
# are skipped with the reason. CI runs `--device cpu --quick` with the project's .venv.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py="python3"; fi
fi
args=()
wheel=""
while [ $# -gt 0 ]; do
    case "$1" in
        --nixl-wheel) wheel="$2"; shift 2 ;;
        --nixl-wheel=*) wheel="${1#*=}"; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
if [ -n "$wheel" ]; then
    target="$(mktemp -d /tmp/gpu-check-nixl.XXXXXX)"
    "$py" -m pip install --quiet --no-deps --no-index --target "$target" "$wheel"
    export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
fi
cd "$root"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec timeout "${GPU_CHECK_TIMEOUT_S:-480}" "$py" -m perf.gpu_check "${args[@]}"
