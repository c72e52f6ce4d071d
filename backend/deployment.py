"""What a deployment loads: the model repository for one mode, rendered with its settings."""
from __future__ import annotations

from pathlib import Path

from build_scripts.render_repository import render


def render_deployment(out_dir: Path, *, mode: str = "aggregated", model_path: str = "",
                      overrides: dict | None = None, prefill_instances: int = 1,
                      decode_instances: int = 1, per_model: dict | None = None) -> Path:
    """Render ``out_dir`` for ``mode`` (``aggregated`` or ``disagg``).

    ``overrides`` apply to every model; ``per_model`` maps model name -> extra parameters.
    """
    common = {"model_path": model_path, **(overrides or {})}
    per_model = per_model or {}
    if mode == "aggregated":
        models = {"llm": {"params": {**common, **per_model.get("llm", {})}, "count": 1}}
    elif mode == "disagg":
        raise NotImplementedError("disaggregated deployment is not available yet")
    else:
        raise ValueError(f"unknown mode {mode!r}; expected 'aggregated' or 'disagg'")
    return render(Path(out_dir), models)
