"""The CPU kernel path this process runs: the CPU's model and identity, the instruction-set
extensions that choose a kernel (AVX2, F16C, AVX-512, VNNI, AMX), torch's CPU capability, our
group kernel's version, fbgemm's fp16-weight path (AVX2 and F16C required) and oneDNN's
bfloat16 path for ``fp16w-bf16``'s many-row products (AMX-BF16 or AVX512-BF16 required). Figures
and tests name it beside what they measured, since a result or a bound can depend on it, as
``formats.kernel_path_line`` writes it (the server's log, the test run's header, the reports)."""

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


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, in /proc/cpuinfo's spelling (empty where there is none)."""
    return frozenset(_cpuinfo().get("flags", "").split())


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
    )
