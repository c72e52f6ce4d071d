"""Start the deployments the benchmarks compare, on one machine split between roles.

Aggregated: ``llm`` gets every core. Disaggregated (1 prefill + 1 decode): the prefill
instance is pinned to the first half of the cores and the decode instance to the rest, each
with as many torch threads as cores, so the two processes don't fight over the same cores.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from backend.launch.deployment import render_deployment
from backend.launch.server import TritonServer
from build_scripts.prepare_model import ensure_model
from perf.lib.metrics import metric_sum  # noqa: F401  (the benchmarks read it from here)


def core_split() -> tuple[str, str, int, int]:
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    pre, dec = cores[:half], cores[half:] or cores[:half]
    return ",".join(map(str, pre)), ",".join(map(str, dec)), len(pre), len(dec)


def start(
    mode: str,
    *,
    model: str | None = None,
    overrides: dict | None = None,
    per_model: dict | None = None,
    log_dir: Path | None = None,
    decode_instances: int = 1,
    extra_env: dict | None = None,
) -> TritonServer:
    """``mode``: ``aggregated`` or ``disagg`` (1 prefill + ``decode_instances`` decode instances,
    cores split between the roles). ``extra_env``: added to the server's environment."""
    model_dir = ensure_model(model)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="triton-disagg-perf-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    overrides = dict(overrides or {})
    per_model = dict(per_model or {})
    if mode == "aggregated":
        n = len(os.sched_getaffinity(0))
        per_model.setdefault("llm", {}).setdefault("num_threads", str(n))
    elif mode == "disagg":
        pre, dec, n_pre, n_dec = core_split()
        per_model["prefill"] = {"cpu_affinity": pre, "num_threads": str(n_pre), **per_model.get("prefill", {})}
        per_model["decode"] = {"cpu_affinity": dec, "num_threads": str(n_dec), **per_model.get("decode", {})}
    repo = render_deployment(
        log_dir / f"repo-{mode}",
        mode=mode,
        model_path=str(model_dir),
        overrides=overrides,
        per_model=per_model,
        decode_instances=decode_instances,
    )
    return TritonServer(repo, log_file=log_dir / f"tritonserver-{mode}.log", extra_env=extra_env).start(timeout_s=400)
