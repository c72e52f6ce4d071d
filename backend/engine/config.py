"""Engine configuration: one validated dataclass, buildable from Triton's string parameters."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineConfig:
    """Settings of one engine instance.

    ``tensor_parallel_size`` > 1 runs the instance as that many rank processes (see
    ``backend/parallel/lead.py``).

    ``num_pages`` defaults to ``ceil(kv_cache_tokens / page_size)``. ``max_model_len`` is capped by
    the model's ``max_position_embeddings`` once the checkpoint's config is read
    (:meth:`resolve_max_model_len`).
    """

    model_path: str
    device: str = "auto"
    dtype: str = "float32"
    page_size: int = 16
    kv_cache_tokens: int = 8192
    num_pages: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    num_threads: int = 0
    max_tokens_limit: int = 4096
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("EngineConfig.model_path is required")
        if self.device != "auto" and not _is_cpu_or_cuda(self.device):
            raise ValueError(f"EngineConfig.device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("page_size", "kv_cache_tokens", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len", "max_tokens_limit", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if self.num_pages is None:
            self.num_pages = -(-self.kv_cache_tokens // self.page_size)
        if not isinstance(self.num_pages, int) or self.num_pages < 1:
            raise ValueError(f"EngineConfig.num_pages must be a positive integer, got {self.num_pages!r}")
        if not isinstance(self.num_threads, int) or self.num_threads < 0:
            raise ValueError(f"EngineConfig.num_threads must be >= 0 (0 = leave torch's default), "
                             f"got {self.num_threads!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("EngineConfig.device is 'cuda' but torch sees no GPU")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def resolve_max_model_len(self) -> int:
        """min(configured cap, the checkpoint's max_position_embeddings)."""
        config_file = Path(self.model_path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} not found: model_path must be a checkpoint directory")
        model_max = json.loads(config_file.read_text()).get("max_position_embeddings")
        return min(self.max_model_len, model_max) if model_max else self.max_model_len

    @classmethod
    def from_dict(cls, values: dict) -> "EngineConfig":
        """Build from a dict whose values may be strings (Triton model parameters are strings).

        Unknown keys are an error; empty strings mean "use the default".
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"unknown engine parameter(s) {unknown}; known: {sorted(fields)}")
        kwargs = {}
        for name, raw in values.items():
            if raw is None or (isinstance(raw, str) and raw.strip() == ""):
                continue
            if name in ("model_path", "device", "dtype"):
                kwargs[name] = str(raw).strip()
                continue
            try:
                kwargs[name] = int(raw)
            except (TypeError, ValueError):
                raise ValueError(f"engine parameter {name!r} must be an integer, got {raw!r}") from None
        if "model_path" not in kwargs:
            raise ValueError("EngineConfig.model_path is required")
        return cls(**kwargs)


def _is_cpu_or_cuda(device: str) -> bool:
    try:
        return torch.device(device).type in ("cpu", "cuda")
    except RuntimeError:
        return False
