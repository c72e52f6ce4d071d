"""What every model's ``initialize`` starts with: logging to stderr, the Triton Python-backend
utilities, the model config and its parameters, the instance name."""

from __future__ import annotations

import json
import logging
import os
import sys


def setup_logging() -> None:
    root = logging.getLogger("triton_disagg")
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        root.addHandler(h)
        root.setLevel(os.environ.get("TRITON_DISAGG_LOG_LEVEL", "INFO"))


def model_parameters(model_config: dict) -> dict:
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def init_model(args: dict):
    """Returns ``(pb_utils, model_config, parameters, instance_name)``."""
    import triton_python_backend_utils as pb_utils

    setup_logging()
    cfg = json.loads(args["model_config"])
    return pb_utils, cfg, model_parameters(cfg), args.get("model_instance_name", cfg["name"])
