"""Where a checkpoint's weights came from, and what names them: :func:`checkpoint_identity`, and
``gguf_source.json`` in its directory, written by
``prepare`` when it converts a GGUF file (the file's name and each tensor's quantization type).
``weights_dtype=auto`` reads it to know whether re-grouping the decoder layers' weights into
``int4w``'s 4-bit groups loses anything: nothing when they were Q4_1 blocks (32 values, each
``d * q + m``, the layout ``int4w`` keeps; the model's load logs how many groups came out exact)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

SOURCE_FILE = "gguf_source.json"
# GGUF types whose blocks int4w's groups hold exactly (Q4_0's ``d * (q - 8)`` need not span the
# range its groups are found from, so it is not here)
INT4W_EXACT_TYPES = frozenset({"Q4_1"})


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def checkpoint_identity(model_path: str | Path) -> str:
    """A name for the checkpoint's weights that changes when they do: its folder's name and a
    digest of its ``config.json`` and of each weight file's name, size and modification time
    (reading every byte would cost a start seconds). The KV cache's page hashes are salted with
    it, so KV saved for other weights is never taken for these."""
    folder = Path(model_path)
    digest = hashlib.blake2b(digest_size=8)
    config = folder / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES) if folder.is_dir() else []:
        stat = path.stat()
        digest.update(f"|{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"{folder.resolve().name}@{digest.hexdigest()}"


def write_source(out_dir: Path, gguf_file: str, tensor_types: dict[str, str]) -> None:
    """Record that ``out_dir``'s weights were converted from ``gguf_file`` (GGUF tensor name ->
    its type name, e.g. ``blk.0.attn_q.weight`` -> ``Q4_1``)."""
    (Path(out_dir) / SOURCE_FILE).write_text(json.dumps({"gguf_file": gguf_file, "tensor_types": tensor_types}))


def layers_in_int4w_groups(model_path: str | Path) -> str | None:
    """The GGUF file the checkpoint at ``model_path`` came from when every linear weight of its
    decoder layers (``blk.*``, two dimensions) was a block type int4w holds exactly; else None
    (no record, or another type)."""
    try:
        source = json.loads((Path(model_path) / SOURCE_FILE).read_text())
        types = source["tensor_types"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    layers = {
        name: kind for name, kind in types.items() if name.startswith("blk.") and not name.endswith("norm.weight")
    }
    if not layers or any(kind not in INT4W_EXACT_TYPES for kind in layers.values()):
        return None
    return str(source.get("gguf_file", "?"))
