"""The CPU kernel path this process runs: the CPU's model and identity, the instruction-set
extensions that choose a kernel (AVX2, F16C, AVX-512, VNNI, AMX), torch's CPU capability, our
group kernel's version, fbgemm's fp16-weight path (AVX2 and F16C required) and oneDNN's
bfloat16 path for ``fp16w-bf16``'s many-row products (AMX-BF16 or AVX512-BF16 required). Figures
and tests name it beside what they measured, since a result or a bound can depend on it, as
``formats.kernel_path_line`` writes it (the server's log, the test run's header, the reports).
``TRITON_DISAGG_CPU=avx2`` makes the process behave as an AVX2-only CPU on any x86-64
(:func:`cpu_flags`, :func:`apply_cpu_mask`)."""

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
# oneDNN's bfloat16 products (``fp16w-bf16``'s and ``int4w-bf16``'s many-row ones) run on AMX
# tiles or with AVX512-BF16's pair dot products: a 512-token prefill of SmolLM2-135M, 2 threads,
# 1.6x float32's on an AMD EPYC (family 25, model 17: AVX512-BF16, no AMX) and faster than float32
# on an Intel Xeon's AMX tiles (perf/REPORT.md). An entry "a|b" of a requirement: either will do.
BF16_PRODUCTS = "amx_bf16|avx512_bf16"
# The group kernel's AVX-512 VNNI version (``kernels/group_avx512_vnni.c``: vpdpwssd on 512-bit registers);
# without them it takes its AVX2 version.
GROUP_VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")


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
    group_kernel: str = "avx2"  # group_kernel(): our kernels' version ("": a recorded path from before them)
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
    def fp16w_path(self) -> str:
        ours = "AVX-512" if self.group_kernel == "avx512_vnni" else "AVX2+FMA"
        return f"fp16 weights, float32 activations and sums (our {ours} kernel, F16C; fbgemm's on one thread beyond)"

    @property
    def int4w_path(self) -> str:
        kernel = "AVX-512 VNNI" if self.group_kernel == "avx512_vnni" else "AVX2+FMA"
        return f"int4 groups of 32 (the LM head int8 groups), int16 activations per group (our {kernel} kernel)"

    @property
    def float32_path(self) -> str:
        kernel = "AVX-512" if self.group_kernel == "avx512_vnni" else "AVX2+FMA"
        return f"float32 weights: our float32 product ({kernel} kernel) for up to 16 rows, MKL's for more"

    @property
    def bf16_path(self) -> str:
        units = [name for flag, name in (("amx_bf16", "AMX tiles"), ("avx512_bf16", "AVX512-BF16")) if flag in self.isa]
        tiles = units[0] if units else "neither AMX-BF16 nor AVX512-BF16: not fp16w-bf16's path"
        return f"oneDNN bfloat16 weights and activations, float32 sums ({tiles})"

    def as_dict(self) -> dict[str, object]:
        return {
            "cpu": self.cpu,
            "cpu_id": self.cpu_id,
            "isa": list(self.isa),
            "torch_capability": self.torch_capability,
            "fp16w_path": self.fp16w_path,
            "bf16_path": self.bf16_path,
            "int4w_path": self.int4w_path,
            "float32_path": self.float32_path,
            "group_kernel": self.group_kernel,
            "mask": self.mask,
            "masked": list(self.masked),
        }

    @classmethod
    def from_dict(cls, recorded: dict) -> KernelPath:
        """A path :meth:`as_dict` recorded (a result envelope's); ``group_kernel``, recorded since
        issue 57, read before that from its int4w path ("" where there was none: no kernel of ours)."""
        int4w = str(recorded.get("int4w_path", ""))
        kernel = recorded.get("group_kernel") or ("avx512_vnni" if "VNNI" in int4w else "avx2" if int4w else "")
        return cls(
            cpu=recorded.get("cpu", "?"),
            cpu_id=recorded.get("cpu_id", "?"),
            isa=tuple(recorded.get("isa", ())),
            torch_capability=recorded.get("torch_capability", "?"),
            group_kernel=kernel,
            mask=recorded.get("mask", "native"),
            masked=tuple(recorded.get("masked", ())),
        )


@functools.cache
def kernel_path() -> KernelPath:
    """This process's kernel path (read once)."""
    import torch

    flags = cpu_flags()
    return KernelPath(
        cpu=cpu_model(),
        cpu_id=cpu_id(),
        isa=tuple(f for f in ISA_FLAGS if f in flags),
        torch_capability=str(torch.backends.cpu.get_cpu_capability()),
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
