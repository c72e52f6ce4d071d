"""What a deployment loads: the model repository for one mode, rendered with its settings.

Modes:
- ``aggregated``: the ``llm`` model alone.
- ``disagg``: front model ``llm`` -> decode models ``decode_<j>`` -> prefill models
  ``prefill_<i>`` (each prefill model one instance with its own messenger port). With a
  membership the front routes to every decode instance of the deployment, on every server.
- ``prefill`` / ``decode``: one side of a split deployment across servers or hosts.
Decode instances find prefill instances in the deployment's membership (``discovery``: the
etcd every instance registers in, ``backend/cluster/``); ``prefill_endpoints`` (a fixed list)
is the alternative for a deployment without etcd.
With ``with_aggregated`` a disaggregated repository also serves ``llm_aggregated``.
"""

from __future__ import annotations

from pathlib import Path

from backend.launch.ports import free_port
from backend.serving.config import MEMBERSHIP_FIELDS
from build_scripts.render_repository import render

# A disaggregated deployment on one machine splits its cores: one torch thread per instance
# unless the caller sets num_threads.
SPLIT_DEFAULTS = {"num_threads": "1"}


def _prefill_models(n: int, common: dict, host: str, bind: str, per_model: dict) -> tuple[dict, list[str]]:
    advertise = {"messenger_advertise": host} if host != bind else {}
    models, endpoints = {}, []
    for i in range(n):
        port = free_port()  # picked here; the bind address may belong to another host/namespace
        name = f"prefill_{i}"
        models[name] = {
            "source": "prefill",
            "count": 1,
            "params": {
                **SPLIT_DEFAULTS,
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


def _decode_models(n: int, common: dict, endpoints: list[str], per_model: dict) -> dict:
    found = {} if common.get("discovery") else {"prefill_endpoints": ",".join(endpoints)}
    return {
        f"decode_{j}": {
            "source": "decode",
            "count": 1,
            "params": {
                **SPLIT_DEFAULTS,
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
) -> Path:
    """Render ``out_dir`` for ``mode``. ``overrides`` apply to every model; ``per_model`` maps a
    model name or a role (``llm``, ``prefill``, ``decode``, ``front``) to extra parameters.
    ``discovery``: the deployment's etcd (``etcd://HOST:PORT``), ``deployment`` its name there."""
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
    if mode in ("disagg", "prefill"):
        prefills, endpoints = _prefill_models(
            prefill_instances, common, messenger_host, messenger_bind or messenger_host, per_model
        )
        models.update(prefills)
    if mode == "decode":
        if not prefill_endpoints and not discovery:
            raise ValueError("decode mode needs the deployment's discovery URL (or a fixed prefill_endpoints list)")
        endpoints = prefill_endpoints or []
    if mode in ("disagg", "decode"):
        decodes = _decode_models(decode_instances, common, endpoints, per_model)
        models.update(decodes)
        # with a membership the front routes to every decode instance of the deployment (this
        # server's by BLS, the others' over gRPC); without one, to this server's decode models
        membership = {k: v for k, v in common.items() if k in MEMBERSHIP_FIELDS}
        targets = membership if discovery else {"decode_models": ",".join(decodes)}
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


def prefill_endpoints_of(repo: Path) -> list[str]:
    """The messenger endpoints a rendered repository's prefill models listen on."""
    from build_scripts.render_repository import read_parameters

    out = []
    for cfg in sorted(Path(repo).glob("prefill_*/config.pbtxt")):
        p = read_parameters(cfg.read_text())
        out.append(f"{p['messenger_host']}:{p['messenger_port']}")
    return out
