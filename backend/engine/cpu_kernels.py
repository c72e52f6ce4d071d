"""The CPU kernel path this process runs: the CPU's model and identity, the instruction-set
extensions that choose a kernel (AVX2, F16C, AVX-512, VNNI, AMX), torch's CPU capability,
fbgemm's int8 path (8-bit activations where its kernel computes them exactly, with VNNI; 7-bit
where int16 pair sums could saturate), its fp16-weight path (AVX2 and F16C required) and oneDNN's
bfloat16 path for ``fp16w-bf16``'s many-row products (AMX-BF16 or AVX512-BF16 required). Figures
and tests name it beside what they measured, since a result or a bound can depend on it
(``perf/lib/machine.py``, the test run's header). ``TRITON_DISAGG_CPU=avx2`` makes the process
behave as an AVX2-only CPU on any x86-64 (:func:`cpu_flags`, :func:`apply_cpu_mask`)."""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# The extensions that select a kernel in torch (ATen's dispatch, oneDNN) or fbgemm, in
# /proc/cpuinfo's spelling.
ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_int8",
)
# What fbgemm's fp16-weight GEMM (``weights_dtype=fp16w``) needs: it refuses to run without them.
FP16W_FLAGS = ("avx2", "f16c")
# ``fp16w-bf16`` adds oneDNN's bfloat16 products for many rows (float32 sums), on AMX tiles or
# with AVX512-BF16's pair dot products: a 512-token prefill of SmolLM2-135M, 2 threads, 1.6x
# float32's on an AMD EPYC (family 25, model 17: AVX512-BF16, no AMX) and faster than float32 on
# an Intel Xeon's AMX tiles (perf/REPORT.md). An entry "a|b" of a requirement: either will do.
BF16_PRODUCTS = "amx_bf16|avx512_bf16"
FP16W_BF16_FLAGS = (*FP16W_FLAGS, BF16_PRODUCTS)
# The CPU features each CPU-only format needs (EngineConfig refuses the format without them).
# ``int4w``: our group kernel (AVX2, FMA) for the decoder layers' 4-bit groups and the LM head's 8-bit ones.
INT4W_FLAGS = (*FP16W_FLAGS, "fma")
# The group kernel's AVX-512 VNNI version (``group_matmul.c``: vpdpwssd on 512-bit registers);
# without them it takes its AVX2 version.
GROUP_VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
FORMAT_FLAGS = {
    "fp16w": FP16W_FLAGS,
    "fp16w-bf16": FP16W_BF16_FLAGS,
    "int4w": INT4W_FLAGS,
    "int4w-bf16": (*INT4W_FLAGS, BF16_PRODUCTS),
}
# The int4w formats whose few-row 4-bit products take int8 activations, and the format each is
# otherwise (its CPU features, kernels for many rows): the one place that says so.
INT8_ACTIVATIONS = {"int4w-a8": "int4w", "int4w-a8-bf16": "int4w-bf16"}
FORMAT_FLAGS |= {a8: FORMAT_FLAGS[base] for a8, base in INT8_ACTIVATIONS.items()}


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none; read once)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


# ``TRITON_DISAGG_CPU``: ``native`` (the default) or ``avx2``, where the whole process behaves as an
# AVX2-only CPU (a Zen 3) on any x86-64: our code sees no flag above AVX2's level (cpu_flags), and
# torch's ATen dispatch, fbgemm and oneDNN are capped at AVX2 by their own variables
# (:data:`LIBRARY_CAPS`, set by :func:`apply_cpu_mask` when ``backend`` is imported, before torch's
# first op; inherited by every process started from it). CI runs the unit tests a second time so.
CPU_MASK_ENV = "TRITON_DISAGG_CPU"
CPU_MASKS = ("native", "avx2")
# the flag families above AVX2's level, in /proc/cpuinfo's spelling
ABOVE_AVX2 = ("avx512", "avx_vnni", "amx", "avx10", "avx_ifma", "avx_ne_convert")
LIBRARY_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def cpu_mask() -> str:
    """The mask asked by ``TRITON_DISAGG_CPU`` (:data:`CPU_MASKS`); a ValueError for another value."""
    mask = os.environ.get(CPU_MASK_ENV, "native") or "native"
    if mask not in CPU_MASKS:
        raise ValueError(f"{CPU_MASK_ENV}={mask!r}: expected one of {', '.join(CPU_MASKS)}")
    return mask


def apply_cpu_mask() -> dict[str, str]:
    """Under ``TRITON_DISAGG_CPU=avx2``, cap torch's, fbgemm's and oneDNN's dispatch at AVX2 through
    their variables (a value the user set stays); returns those in force. Must run before torch's
    first op (``backend/__init__.py`` calls it): ATen reads its variable once."""
    if cpu_mask() != "avx2":
        return {}
    for name, value in LIBRARY_CAPS.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in LIBRARY_CAPS}


def native_flags() -> frozenset[str]:
    """The CPU's own feature flags, in /proc/cpuinfo's spelling (empty where there is none)."""
    return frozenset(_cpuinfo().get("flags", "").split())


def cpu_flags() -> frozenset[str]:
    """The feature flags this process uses, in /proc/cpuinfo's spelling: the CPU's own, less
    those above AVX2's level under ``TRITON_DISAGG_CPU=avx2``. Every choice of a kernel reads them here."""
    flags = native_flags()
    if cpu_mask() == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(ABOVE_AVX2))
    return flags


def masked_flags() -> tuple[str, ...]:
    """The CPU's flags that ``TRITON_DISAGG_CPU`` hides from this process, sorted (empty: none)."""
    return tuple(sorted(native_flags() - cpu_flags()))


def missing_flags(required: Iterable[str]) -> list[str]:
    """Those of ``required`` (in /proc/cpuinfo's spelling; "a|b": either) this CPU lacks, in
    their order (an alternative as "a or b")."""
    flags = cpu_flags()
    return [_spelled(entry) for entry in required if not flags & set(entry.split("|"))]


def _spelled(entry: str) -> str:
    """A requirement's entry for a message: "amx_bf16|avx512_bf16" -> "amx_bf16 or avx512_bf16"."""
    return entry.replace("|", " or ")


def requirement(required: Iterable[str]) -> str:
    """``required`` for a message: "avx2 and f16c and (amx_bf16 or avx512_bf16)"."""
    return " and ".join(f"({_spelled(e)})" if "|" in e else e for e in required)


def group_kernel() -> str:
    """Which version of int4w's group kernel runs: ``avx512_vnni`` where the CPU has
    :data:`GROUP_VNNI_FLAGS`, else ``avx2``; ``TRITON_DISAGG_KERNELS=avx2`` keeps the AVX2 one on
    any CPU (to compare the two; ``auto``, the default, chooses by the CPU)."""
    forced = os.environ.get("TRITON_DISAGG_KERNELS", "auto")
    if forced not in ("auto", "avx2"):
        raise ValueError(f"TRITON_DISAGG_KERNELS={forced!r}: expected auto or avx2")
    return "avx512_vnni" if forced == "auto" and not missing_flags(GROUP_VNNI_FLAGS) else "avx2"


def cpu_model() -> str:
    """The CPU's model name, e.g. "AMD EPYC 7B13"."""
    return _cpuinfo().get("model name") or platform.processor() or "unknown"


def cpu_id() -> str:
    """``family F, model M`` (a VM may name its CPU no more than "AMD EPYC")."""
    info = _cpuinfo()
    return f"family {info.get('cpu family', '?')}, model {info.get('model', '?')}"


@dataclass(frozen=True)
class KernelPath:
    cpu: str  # cpu_model()
    cpu_id: str  # cpu_id()
    isa: tuple[str, ...]  # the ISA_FLAGS this CPU has
    torch_capability: str  # ATen's vectorized-kernel level: "AVX2", "AVX512", ...
    int8_full_range: bool  # fbgemm's int8 product is exact with 8-bit activations
    group_kernel: str = "avx2"  # group_kernel(): int4w's kernel version
    mask: str = "native"  # cpu_mask()
    masked: tuple[str, ...] = ()  # masked_flags()

    @property
    def mask_line(self) -> str:
        """What ``TRITON_DISAGG_CPU`` changes in this process, for a header or a log line."""
        if self.mask == "native":
            return f"cpu mask: none ({CPU_MASK_ENV} unset: the CPU's own features)"
        hidden = " ".join(self.masked) or "none (this CPU has nothing above AVX2)"
        caps = ", ".join(f"{k}={v}" for k, v in LIBRARY_CAPS.items())
        return f"cpu mask: {CPU_MASK_ENV}={self.mask}: as an AVX2-only CPU; hidden: {hidden}; {caps}"

    @property
    def int8_path(self) -> str:
        return (
            "fbgemm int8, 8-bit activations (exact: VNNI)"
            if self.int8_full_range
            else "fbgemm int8, 7-bit activations (no VNNI: 8-bit pair sums would saturate int16)"
        )

    @property
    def fp16w_path(self) -> str:
        ours = "AVX-512" if self.group_kernel == "avx512_vnni" else "AVX2+FMA"
        return f"fp16 weights, float32 activations and sums (our {ours} kernel, F16C; fbgemm's on one thread beyond)"

    @property
    def int4w_path(self) -> str:
        return self._int4w_path(16)

    def _int4w_path(self, acts: int) -> str:
        kernel = "AVX-512 VNNI" if self.group_kernel == "avx512_vnni" else "AVX2+FMA"
        if acts == 8:
            kernel += " vpdpbusd" if self.group_kernel == "avx512_vnni" else " vpmaddubsw"
        return f"int4 groups of 32 (the LM head int8 groups), int{acts} activations per group (our {kernel} kernel)"

    @property
    def float32_path(self) -> str:
        kernel = "AVX-512" if self.group_kernel == "avx512_vnni" else "AVX2+FMA"
        return f"float32 weights: our float32 product ({kernel} kernel) for up to 16 rows, MKL's for more"

    @property
    def bf16_path(self) -> str:
        units = [name for flag, name in (("amx_bf16", "AMX tiles"), ("avx512_bf16", "AVX512-BF16")) if flag in self.isa]
        tiles = units[0] if units else "neither AMX-BF16 nor AVX512-BF16: not fp16w-bf16's path"
        return f"oneDNN bfloat16 weights and activations, float32 sums ({tiles})"

    def short(self, weights: str = "int8") -> str:
        """One line for a table's caption or a log line, with the kernel path of the weights
        format ``weights`` (``int8``, ``float32``, ``fp16w``, ``fp16w-bf16`` or an int4w format)."""
        path = {
            "float32": self.float32_path,
            "fp16w": self.fp16w_path,
            "fp16w-bf16": f"{self.fp16w_path} for few rows; {self.bf16_path} for many",
        }
        for fmt in ("int4w", "int4w-bf16", *INT8_ACTIVATIONS):
            bf16 = fmt.endswith("-bf16")
            many = f"fp16w-bf16's (float16, {self.bf16_path})" if bf16 else "fp16w's products (float16, float32)"
            path[fmt] = f"{self._int4w_path(8 if fmt in INT8_ACTIVATIONS else 16)} for up to 16 rows; {many} for more"
        return f"{self.cpu} ({self.cpu_id}); torch {self.torch_capability}; {path.get(weights, self.int8_path)}"

    def as_dict(self) -> dict[str, object]:
        return {
            "cpu": self.cpu,
            "cpu_id": self.cpu_id,
            "isa": list(self.isa),
            "torch_capability": self.torch_capability,
            "int8_path": self.int8_path,
            "fp16w_path": self.fp16w_path,
            "bf16_path": self.bf16_path,
            "int4w_path": self.int4w_path,
            "float32_path": self.float32_path,
            "mask": self.mask,
            "masked": list(self.masked),
        }


@functools.cache
def kernel_path() -> KernelPath:
    """This process's kernel path (read once: the int8 check runs one small product)."""
    import torch

    from backend.engine.int8_linear import full_range_is_exact

    flags = cpu_flags()
    return KernelPath(
        cpu=cpu_model(),
        cpu_id=cpu_id(),
        isa=tuple(f for f in ISA_FLAGS if f in flags),
        torch_capability=str(torch.backends.cpu.get_cpu_capability()),
        int8_full_range=full_range_is_exact(),
        group_kernel=group_kernel(),
        mask=cpu_mask(),
        masked=masked_flags(),
    )


def mask_mismatch(path: KernelPath) -> str | None:
    """None when torch's dispatch honours the mask; else why not (torch ran an op before
    :func:`apply_cpu_mask`, or the user capped it elsewhere)."""
    if path.mask == "avx2" and path.torch_capability.upper().startswith("AVX512"):
        return (
            f"{CPU_MASK_ENV}=avx2, yet torch dispatches {path.torch_capability}: its capability was read "
            "before backend was imported (set ATEN_CPU_CAPABILITY=avx2 too, or import backend first)"
        )
    return None
