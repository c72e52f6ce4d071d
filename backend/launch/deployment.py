"""What a deployment loads: the model repository for one mode, rendered with its settings.

Modes:
- ``aggregated``: the ``llm`` model alone.
- ``disagg``: front model ``llm`` -> decode models ``decode_<j>`` -> prefill models
  ``prefill_<i>`` (each prefill model one instance with its own messenger port). With a
  membership the front routes to every decode instance of the deployment, on every server
  (a ``decode`` server's front: to its own decode models).
- ``prefill`` / ``decode``: one side of a split deployment across servers or hosts.
Decode instances find prefill instances in the deployment's membership (``discovery``: the
etcd every instance registers in, ``backend/cluster/``); ``prefill_endpoints`` (a fixed list)
is the alternative for a deployment without etcd.
With ``with_aggregated`` a disaggregated repository also serves ``llm_aggregated``.
"""

from __future__ import annotations

import os
from pathlib import Path

from backend.launch.ports import free_port
from backend.serving.config import MEMBERSHIP_FIELDS
from build_scripts.render_repository import render

# How a server of a disaggregated deployment gives its cores to the roles (defaults under every
# parameter the caller sets): "split" (what the launcher, so `serve` and the benchmarks, run,
# backend/launch/launcher.py): on a disagg server
# the prefill instances are pinned to the first half of the usable cores and the decode
# instances to the rest, each with as many torch threads as its half has cores, so the roles
# never fight over a core; "shared": nothing pinned, one torch thread per instance (the test
# fixtures: several instances per role on 2 cores). A prefill- or decode-only server shares.
PLACEMENTS = ("split", "shared")
SHARED = {"num_threads": "1"}


def core_split() -> tuple[str, str, int, int]:
    """(prefill cores, decode cores, their counts): the first half of the usable cores and the rest."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    pre, dec = cores[:half], cores[half:] or cores[:half]
    return ",".join(map(str, pre)), ",".join(map(str, dec)), len(pre), len(dec)


def placement_defaults(placement: str, mode: str) -> dict[str, dict]:
    """Role (``prefill``, ``decode``) -> its default parameters under ``placement``."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r} is not one of {list(PLACEMENTS)}")
    if placement == "shared" or mode != "disagg":
        return {"prefill": SHARED, "decode": SHARED}
    pre, dec, n_pre, n_dec = core_split()
    return {
        "prefill": {"cpu_affinity": pre, "num_threads": str(n_pre)},
        "decode": {"cpu_affinity": dec, "num_threads": str(n_dec)},
    }


def _prefill_models(
    n: int, common: dict, host: str, bind: str, per_model: dict, defaults: dict
) -> tuple[dict, list[str]]:
    advertise = {"messenger_advertise": host} if host != bind else {}
    models, endpoints = {}, []
    for i in range(n):
        port = free_port()  # picked here; the bind address may belong to another host/namespace
        name = f"prefill_{i}"
        models[name] = {
            "source": "prefill",
            "count": 1,
            "params": {
                **defaults,
                **common,
                "messenger_host": bind,
                "messenger_port": port,
                **advertise,
                **per_model.get("prefill", {}),
                **per_model.get(name, {}),
            },
        }
        endpoints.append(f"{host}:{port}")
    return models, endpoints


def _decode_models(n: int, common: dict, endpoints: list[str], per_model: dict, defaults: dict) -> dict:
    found = {} if common.get("discovery") else {"prefill_endpoints": ",".join(endpoints)}
    return {
        f"decode_{j}": {
            "source": "decode",
            "count": 1,
            "params": {
                **defaults,
                **common,
                **found,
                **per_model.get("decode", {}),
                **per_model.get(f"decode_{j}", {}),
            },
        }
        for j in range(n)
    }


def render_deployment(
    out_dir: Path,
    *,
    mode: str = "aggregated",
    model_path: str = "",
    overrides: dict | None = None,
    prefill_instances: int = 1,
    decode_instances: int = 1,
    per_model: dict | None = None,
    prefill_endpoints: list[str] | None = None,
    messenger_host: str = "127.0.0.1",
    messenger_bind: str | None = None,
    with_aggregated: bool = False,
    discovery: str = "",
    deployment: str = "",
    placement: str = "shared",
) -> Path:
    """Render ``out_dir`` for ``mode``. ``overrides`` apply to every model; ``per_model`` maps a
    model name or a role (``llm``, ``prefill``, ``decode``, ``front``) to extra parameters.
    ``discovery``: the deployment's etcd (``etcd://HOST:PORT``), ``deployment`` its name there.
    ``placement``: the roles' cores (:data:`PLACEMENTS`), under the parameters given."""
    common = {"model_path": model_path, **(overrides or {})}
    if mode != "aggregated":
        common.update({"discovery": discovery} if discovery else {})
        common.update({"deployment": deployment} if deployment else {})
    per_model = per_model or {}
    agg = {"params": {**common, **per_model.get("llm", {})}, "count": 1, "source": "llm"}
    if mode == "aggregated":
        return render(Path(out_dir), {"llm": agg})
    if mode not in ("disagg", "prefill", "decode"):
        raise ValueError(f"unknown mode {mode!r}; expected aggregated, disagg, prefill or decode")
    models: dict = {}
    defaults = placement_defaults(placement, mode)
    if mode in ("disagg", "prefill"):
        prefills, endpoints = _prefill_models(
            prefill_instances, common, messenger_host, messenger_bind or messenger_host, per_model, defaults["prefill"]
        )
        models.update(prefills)
    if mode == "decode":
        if not prefill_endpoints and not discovery:
            raise ValueError("decode mode needs the deployment's discovery URL (or a fixed prefill_endpoints list)")
        endpoints = prefill_endpoints or []
    if mode in ("disagg", "decode"):
        decodes = _decode_models(decode_instances, common, endpoints, per_model, defaults["decode"])
        models.update(decodes)
        # a disagg server's front routes to every decode instance of the deployment's membership;
        # a decode-only server's front (and any front without a membership) to this server's
        # decode models: every front that spans the deployment probes every decode instance, and
        # a decode-only server is one of many. Either reads the instances' records (their health,
        # draining, cache summaries) where there is a membership.
        membership = {k: v for k, v in common.items() if k in MEMBERSHIP_FIELDS}
        targets = membership if discovery and mode == "disagg" else {**membership, "decode_models": ",".join(decodes)}
        models["llm"] = {
            "source": "front",
            "count": 1,
            "params": {
                **targets,
                "model_path": model_path,  # its tokenizer: KV-aware routing
                **per_model.get("front", {}),
            },
        }
        if with_aggregated:
            models["llm_aggregated"] = agg
    return render(Path(out_dir), models)
