"""Render a deployment's Triton model repository from the templates in ``model_repository/``.

Each template (``<model>/config.pbtxt.template``) has placeholders: ``{{name}}``, ``{{count}}``,
the tensor lists (``{{client_inputs}}``, ``{{decode_inputs}}``, ``{{prefill_inputs}}``,
``{{client_outputs}}``, ``{{prefill_outputs}}``, from ``backend/serving/tensors.py``) and
``{{parameters}}``: every parameter of the model's role, with the deployment's value or its
default (``backend/serving/config.py``). An unknown parameter or a malformed value is refused
here, naming it, before any server starts; a renamed one given under its old name is rendered
under its new name (``backend/cluster/config.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from backend.disagg.auth import accept_renamed
from backend.serving.config import check_parameters, parameter_defaults
from backend.serving.tensors import CONTROL_INPUTS, INPUTS, OUTPUTS, TensorSpec, pbtxt_list

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "model_repository"
TEMPLATE = "config.pbtxt.template"
ROLE_OF_TEMPLATE = {"llm": "aggregated", "decode": "decode", "prefill": "prefill", "front": "front"}
_PARAM = re.compile(r'\{\s*key:\s*"(?P<key>[^"]+)",\s*value:\s*\{\s*string_value:\s*"(?P<val>[^"]*)"\s*\}\s*\}')
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")

TENSOR_LISTS = {
    "client_inputs": pbtxt_list(INPUTS),
    # optional on decode so that a front model reaching it by BLS can cancel (cancel_request_id)
    "decode_inputs": pbtxt_list(INPUTS + CONTROL_INPUTS, force_optional=True),
    # a prefill model takes no client requests (it answers one with an error saying so)
    "prefill_inputs": pbtxt_list((TensorSpec("text_input", "TYPE_STRING"),)),
    "client_outputs": pbtxt_list(OUTPUTS),
    "prefill_outputs": pbtxt_list((TensorSpec("text_output", "TYPE_STRING", optional=False),)),
}


def read_parameters(config_text: str) -> dict:
    return {m["key"]: m["val"] for m in _PARAM.finditer(config_text)}


def render_config(template: str, name: str, role: str, params: dict, count: int = 1) -> str:
    """One model's config.pbtxt text."""
    if count < 1:
        raise ValueError(f"instance count must be >= 1, got {count}")
    params = {k: str(v) for k, v in params.items()}
    if "role" in params and params["role"] != role:
        raise ValueError(f"model {name!r}: parameter role={params['role']!r} but the template is a {role} model")
    params.pop("role", None)
    try:
        params = accept_renamed(params)
        check_parameters(role, params)
    except ValueError as e:
        raise ValueError(f"model {name!r}: {e}") from None
    values = {**parameter_defaults(role), **params}
    for k, v in values.items():
        if '"' in v or "\n" in v or "\\" in v:
            raise ValueError(f"model {name!r}: parameter {k!r}: value may not contain quotes, backslashes or newlines")
    fills = {
        "name": name,
        "count": str(count),
        **TENSOR_LISTS,
        "parameters": ",\n".join(f'  {{ key: "{k}", value: {{ string_value: "{v}" }} }}' for k, v in values.items()),
    }

    def fill(m):
        if m.group(1) not in fills:
            raise ValueError(f"template of {name!r}: unknown placeholder {m.group(0)}")
        return fills[m.group(1)]

    return _PLACEHOLDER.sub(fill, template)


def render(out_dir: Path, models: dict[str, dict], template_dir: Path = TEMPLATE_DIR) -> Path:
    """``models``: name -> {"params": {...}, "count": int, "source": template model name}."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    for name, spec in models.items():
        source = spec.get("source", name)
        src = template_dir / source
        if source not in ROLE_OF_TEMPLATE or not (src / TEMPLATE).is_file():
            raise FileNotFoundError(f"no model template {source!r} in {template_dir}")
        dst = out_dir / name
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", TEMPLATE))
        text = render_config(
            (src / TEMPLATE).read_text(),
            name,
            ROLE_OF_TEMPLATE[source],
            spec.get("params") or {},
            int(spec.get("count") or 1),
        )
        (dst / "config.pbtxt").write_text(text)
    return out_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out_dir")
    p.add_argument("--spec", required=True, help='JSON: {"llm": {"params": {...}, "count": 1}}')
    args = p.parse_args(argv)
    print(render(Path(args.out_dir), json.loads(args.spec)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
