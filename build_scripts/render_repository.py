"""Render a deployment's Triton model repository from ``model_repository/``.

Copies the chosen models and rewrites their ``config.pbtxt`` parameters (string values) and
instance counts. Our configs keep each parameter on one line
(``{ key: "k", value: { string_value: "v" } }``), which is what the rewrite relies on.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "model_repository"
_PARAM = re.compile(r'\{\s*key:\s*"(?P<key>[^"]+)",\s*value:\s*\{\s*string_value:\s*"(?P<val>[^"]*)"\s*\}\s*\}')
_COUNT = re.compile(r"(instance_group\s*\[\s*\{\s*count:\s*)(\d+)")


def read_parameters(config_text: str) -> dict:
    return {m["key"]: m["val"] for m in _PARAM.finditer(config_text)}


def set_parameters(config_text: str, params: dict) -> str:
    """Replace existing parameters and append new ones to the parameters list."""
    params = {k: str(v) for k, v in params.items()}
    for k, v in params.items():
        if '"' in v or "\n" in v:
            raise ValueError(f"parameter {k!r}: value may not contain quotes or newlines")
    seen = set()

    def repl(m):
        seen.add(m["key"])
        if m["key"] in params:
            return f'{{ key: "{m["key"]}", value: {{ string_value: "{params[m["key"]]}" }} }}'
        return m.group(0)
    text = _PARAM.sub(repl, config_text)
    new = [f'  {{ key: "{k}", value: {{ string_value: "{v}" }} }}' for k, v in params.items() if k not in seen]
    if new:
        if "parameters [" not in text:
            text += "\nparameters [\n" + ",\n".join(new) + "\n]\n"
        else:
            head, tail = text.rsplit("parameters [", 1)
            body, rest = _split_params(tail)
            sep = ",\n" if body.strip() else "\n"
            text = head + "parameters [" + body.rstrip() + sep + ",\n".join(new) + "\n]" + rest
    return text


def _split_params(tail: str) -> tuple[str, str]:
    depth = 0
    for i, ch in enumerate(tail):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "]" and depth == 0:
            return tail[:i], tail[i + 1:]
    raise ValueError("unterminated parameters list in config.pbtxt")


def set_instance_count(config_text: str, count: int) -> str:
    if count < 1:
        raise ValueError(f"instance count must be >= 1, got {count}")
    text, n = _COUNT.subn(lambda m: m.group(1) + str(count), config_text)
    if n != 1:
        raise ValueError("config.pbtxt must have exactly one instance_group with a count")
    return text


def render(out_dir: Path, models: dict[str, dict], template_dir: Path = TEMPLATE_DIR) -> Path:
    """``models``: name -> {"params": {...}, "count": int, "source": template model name}."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    for name, spec in models.items():
        src = template_dir / spec.get("source", name)
        if not (src / "config.pbtxt").is_file():
            raise FileNotFoundError(f"no model {spec.get('source', name)!r} in {template_dir}")
        dst = out_dir / name
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        text = (dst / "config.pbtxt").read_text()
        text = re.sub(r'^name:\s*"[^"]*"', f'name: "{name}"', text, count=1, flags=re.M)
        if spec.get("params"):
            text = set_parameters(text, spec["params"])
        if spec.get("count"):
            text = set_instance_count(text, int(spec["count"]))
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
