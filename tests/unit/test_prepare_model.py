"""Model preparation: the packaged GGUF is converted once; HF checkpoint dirs are accepted as is."""

import json
import time

import pytest

from build_scripts.prepare_model import DEFAULT_MODEL_DIR, ensure_model
from tests.engine_helpers import build_tiny_llama


def test_default_model_is_a_fast_loading_checkpoint(model_dir):
    assert model_dir == DEFAULT_MODEL_DIR and (model_dir / "config.json").is_file()
    assert list(model_dir.glob("*.safetensors")) and (model_dir / "tokenizer.json").is_file()
    t0 = time.perf_counter()
    assert ensure_model() == model_dir  # no second conversion
    assert time.perf_counter() - t0 < 1.0


def test_hf_checkpoint_dir_is_accepted(tmp_path):
    path = build_tiny_llama(tmp_path / "tiny")
    assert ensure_model(path) == path.resolve()


def test_unsupported_or_missing_checkpoint_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        ensure_model(tmp_path)
    path = build_tiny_llama(tmp_path / "tiny")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "bert"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'bert' is not supported"):
        ensure_model(path)
