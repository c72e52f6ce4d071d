"""Engine configuration: one validated dataclass, and the parser of typed config sections from
Triton's string parameters that every layer's config uses (``parse_section``)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from backend.engine.cpu_kernels import missing_flags, requirement
from backend.engine.formats import DTYPES, WEIGHT_FORMATS, choose_kv_format, choose_weights_format, weight_format
from backend.engine.step_profile import profile_path

if TYPE_CHECKING:
    import torch


def cache_root() -> Path:
    """Where the engine keeps what it builds or saves for later runs (compiled kernels, the disk KV
    tier): ``$TRITON_DISAGG_CACHE``, default ``~/.cache/triton-disagg``."""
    return Path(os.environ.get("TRITON_DISAGG_CACHE") or Path.home() / ".cache" / "triton-disagg")


def _torch():
    import torch

    return torch


# auto: the lean layer loop (backend/engine/lean_decoder.py) where the checkpoint's layers fit it
# and the model runs in one process, and with int4w weights its decode steps of up to 16 sequences
# as one kernel call (backend/engine/fused_decode.py) where that applies; lean: the lean layer loop
# only; transformers: always transformers' own modules
DECODERS = ("auto", "lean", "transformers")
DISK_READERS = ("auto", "nixl", "plain")  # how the disk KV tier reads its files (kv_disk_reader)


@dataclass
class EngineConfig:
    """Settings of one engine instance.

    ``tensor_parallel_size`` > 1 runs the instance as that many rank processes (see
    ``backend/parallel/lead.py``).

    ``num_pages`` defaults to ``ceil(kv_cache_tokens / page_size)``. ``max_model_len`` is capped by
    the model's ``max_position_embeddings`` once the checkpoint's config is read
    (:meth:`resolve_max_model_len`).

    Formats: ``dtype`` is the default of both ``weights_dtype`` (the weights and the activations
    computed with them: a dtype, or one of the CPU formats of ``formats.py``, whose entries say
    what each needs and runs) and ``kv_dtype`` (the KV pool; ``auto``, the default: float16 on the
    CPU under the formats whose entry says so (``kv16``: the fused decode step reads it widened,
    and the held-out quality is float32 KV's), else as ``dtype``, so float32 weights stay exact;
    ``kv_choice`` says why). They are independent: a float32 model may keep a bfloat16 KV cache.
    The CPU formats run on the CPU in one process only. ``weights_dtype=auto`` (the default) is
    resolved here, once, into a format (``formats.choose_weights_format``); ``weights_choice``
    says why.

    KV tiers below the pool (with prefix caching, one process; ``kv_tiers.py``): a host tier of
    ``kv_host_tokens`` tokens (default: as many as the pool; 0: none) and a disk tier of at most
    ``kv_disk_bytes`` (0: none) under ``kv_disk_path`` (default: ``kv`` in the user's cache,
    :func:`cache_root`), which takes blocks hit at least ``kv_disk_admit_hits`` times and reads
    them with ``kv_disk_reader`` (``auto``: NIXL's POSIX file backend where it starts, else plain
    file I/O; ``nixl``: NIXL's or refuse to start; ``plain``; the serving layer builds it); a shared
    tier in the store at ``kv_store_url`` (``redis://HOST:PORT``; empty: none), every call to it
    bounded by ``kv_store_timeout_s`` (the serving layer connects: ``backend/cluster/kv_store.py``).

    ``emulate``: an engine profile (a name shipped in ``backend/engine/profiles/``, or a JSON
    file's path; ``step_profile.py``): the instance loads no model and computes nothing; each step
    waits what the profile says it takes, and its tokens come from a deterministic generator that
    reads the KV cache (``emulated_runner.py``). The checkpoint still gives the tokenizer and the
    vocabulary. One process only; the weight and KV formats are float32 unless set.
    """

    model_path: str
    device: str = "auto"
    dtype: str = "float32"
    page_size: int = 16
    kv_cache_tokens: int = 16384
    num_pages: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    max_model_len: int = 4096
    num_threads: int = 0
    max_tokens_limit: int = 1024
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    weights_dtype: str = "auto"
    kv_dtype: str = "auto"
    decoder: str = "auto"
    kv_host_tokens: int | None = None
    kv_disk_bytes: int = 4 << 30
    kv_disk_path: str = ""
    kv_disk_admit_hits: int = 2
    kv_disk_reader: str = "auto"
    kv_store_url: str = ""
    kv_store_timeout_s: float = 0.5
    emulate: str = ""
    # why weights_dtype is what it is (set by __post_init__; "" where it was set explicitly)
    weights_choice: str = field(default="", init=False, compare=False)
    kv_choice: str = field(default="", init=False, compare=False)  # why kv_dtype is what it is (auto)

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("EngineConfig.model_path is required")
        if self.device != "auto" and not _is_cpu_or_cuda(self.device):
            raise ValueError(f"EngineConfig.device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.emulate:
            profile_path(self.emulate)  # a name or path that is not there fails here, naming the shipped ones
            if self.tensor_parallel_size != 1:
                raise ValueError("EngineConfig.emulate runs in one process: tensor_parallel_size must be 1")
            if self.weights_dtype == "auto":
                self.weights_dtype, self.weights_choice = self.dtype, "emulated: no weights are loaded"
        if self.weights_dtype == "auto":
            self.weights_dtype, self.weights_choice = choose_weights_format(
                self.dtype, self.torch_device.type, self.tensor_parallel_size, self.model_path
            )
        if self.weights_format not in WEIGHT_FORMATS:
            raise ValueError(
                f"EngineConfig.weights_dtype must be one of {list(WEIGHT_FORMATS)}, got {self.weights_dtype!r}"
            )
        if self.emulate and self.kv_dtype in ("auto", ""):
            self.kv_dtype, self.kv_choice = self.dtype, "emulated"
        if self.kv_dtype in ("auto", ""):
            self.kv_dtype, self.kv_choice = choose_kv_format(self.dtype, self.weights_format, self.torch_device.type)
        if self.kv_format not in DTYPES:
            raise ValueError(f"EngineConfig.kv_dtype must be auto or one of {sorted(DTYPES)}, got {self.kv_dtype!r}")
        if self.decoder not in DECODERS:
            raise ValueError(f"EngineConfig.decoder must be one of {list(DECODERS)}, got {self.decoder!r}")
        fmt = weight_format(self.weights_format)
        if fmt.cpu_only and self.tensor_parallel_size != 1:
            raise ValueError(
                f"EngineConfig.weights_dtype {self.weights_format} is not supported with tensor_parallel_size > 1"
            )
        for name in (
            "page_size",
            "kv_cache_tokens",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "max_tokens_limit",
            "tensor_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if self.num_pages is None:
            self.num_pages = -(-self.kv_cache_tokens // self.page_size)
        if self.kv_host_tokens is None:
            self.kv_host_tokens = self.num_pages * self.page_size
        if not isinstance(self.kv_store_timeout_s, (int, float)) or not 0 < self.kv_store_timeout_s <= 60:
            raise ValueError(f"EngineConfig.kv_store_timeout_s must be in (0, 60], got {self.kv_store_timeout_s!r}")
        if self.kv_disk_reader not in DISK_READERS:
            raise ValueError(
                f"EngineConfig.kv_disk_reader must be one of {', '.join(DISK_READERS)}, got {self.kv_disk_reader!r}"
            )
        for name in ("kv_host_tokens", "kv_disk_bytes", "kv_disk_admit_hits"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 0 (0: none), got {value!r}")
        if not isinstance(self.num_pages, int) or self.num_pages < 1:
            raise ValueError(f"EngineConfig.num_pages must be a positive integer, got {self.num_pages!r}")
        if not isinstance(self.num_threads, int) or self.num_threads < 0:
            raise ValueError(
                f"EngineConfig.num_threads must be >= 0 (0 = leave torch's default), got {self.num_threads!r}"
            )
        if self.device.startswith("cuda") and not _torch().cuda.is_available():
            raise ValueError("EngineConfig.device is 'cuda' but torch sees no GPU")
        if fmt.cpu_only and self.torch_device.type != "cpu":
            raise ValueError(f"EngineConfig.weights_dtype {fmt.name} runs on the CPU only ({fmt.cpu_only})")
        missing = missing_flags(fmt.needs)
        if missing:
            raise ValueError(
                f"EngineConfig.weights_dtype {fmt.name} needs the CPU features {requirement(fmt.needs)} "
                f"({fmt.cpu_only}); this CPU lacks {', '.join(missing)}"
            )

    def settings(self) -> dict:
        """The init fields and their values (what rebuilds this config in another process)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @property
    def torch_device(self) -> torch.device:
        torch = _torch()
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def disk_tier_folder(self) -> Path:
        return Path(self.kv_disk_path) if self.kv_disk_path else cache_root() / "kv"

    @property
    def weights_format(self) -> str:
        return self.weights_dtype or self.dtype

    @property
    def kv_format(self) -> str:
        return self.kv_dtype or self.dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        """The activations' dtype (and the float weights'): float32 under fp16w and int4w weights."""
        return getattr(_torch(), weight_format(self.weights_format).activations)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return getattr(_torch(), self.kv_format)

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
        if not str(values.get("model_path") or "").strip():
            raise ValueError("EngineConfig.model_path is required")
        return parse_section(cls, values, "engine")


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def parse_value(name: str, raw, typ) -> object:
    """One parameter value (a string from config.pbtxt, or already typed) as ``typ``."""
    if isinstance(typ, type) and dataclasses.is_dataclass(typ):  # a section: given parsed, never as a value
        if isinstance(raw, typ):
            return raw
        raise ValueError(f"parameter {name!r} names a section of settings, not a value")
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE | _FALSE:
            return text in _TRUE
        raise ValueError(f"parameter {name!r} must be true or false, got {raw!r}")
    if typ is int:
        try:
            return int(str(raw).strip())
        except ValueError:
            raise ValueError(f"parameter {name!r} must be an integer, got {raw!r}") from None
    if typ is float:
        try:
            value = float(str(raw).strip())
        except ValueError:
            raise ValueError(f"parameter {name!r} must be a number, got {raw!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"parameter {name!r} must be a finite number, got {raw!r}")
        return value
    return str(raw).strip()


def field_types(cls) -> dict[str, type]:
    """Init fields of a config dataclass -> their value type (``X | None`` -> X)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        typ = hints[f.name]
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        out[f.name] = args[0] if args else typ
    return out


def parse_section(cls, values: dict, section: str):
    """An instance of the config dataclass ``cls`` from ``values`` (strings or typed values);
    empty strings mean "use the default"; a key ``cls`` does not have is an error naming it."""
    types = field_types(cls)
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ValueError(f"unknown {section} parameter(s) {unknown}; known: {sorted(types)}")
    kwargs = {}
    for name, raw in values.items():
        if raw is None or (isinstance(raw, str) and raw.strip() == ""):
            continue
        kwargs[name] = parse_value(name, raw, types[name])
    return cls(**kwargs)


def _is_cpu_or_cuda(device: str) -> bool:
    try:
        return _torch().device(device).type in ("cpu", "cuda")
    except RuntimeError:
        return False
