"""The CPU kernel path this process runs: the CPU's model and identity, the instruction-set
extensions that choose a kernel (AVX2, F16C, AVX-512, VNNI, AMX), torch's CPU capability, and
fbgemm's int8 path (8-bit activations where its kernel computes them exactly, with VNNI; 7-bit
where int16 pair sums could saturate). Figures and tests name it beside what they measured, since
a result or a bound can depend on it (``perf/lib/machine.py``, the test run's header)."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

# The extensions that select a kernel in torch (ATen's dispatch, oneDNN) or fbgemm, in
# /proc/cpuinfo's spelling.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
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

    @property
    def int8_path(self) -> str:
        return (
            "fbgemm int8, 8-bit activations (exact: VNNI)"
            if self.int8_full_range
            else "fbgemm int8, 7-bit activations (no VNNI: 8-bit pair sums would saturate int16)"
        )

    def short(self) -> str:
        """One line for a table's caption or a log line."""
        return f"{self.cpu} ({self.cpu_id}); torch {self.torch_capability}; {self.int8_path}"

    def as_dict(self) -> dict[str, object]:
        return {
            "cpu": self.cpu,
            "cpu_id": self.cpu_id,
            "isa": list(self.isa),
            "torch_capability": self.torch_capability,
            "int8_path": self.int8_path,
        }


@functools.cache
def kernel_path() -> KernelPath:
    """This process's kernel path (read once: the int8 check runs one small product)."""
    import torch

    from backend.engine.int8_linear import full_range_is_exact

    flags = set(_cpuinfo().get("flags", "").split())
    return KernelPath(
        cpu=cpu_model(),
        cpu_id=cpu_id(),
        isa=tuple(f for f in ISA_FLAGS if f in flags),
        torch_capability=str(torch.backends.cpu.get_cpu_capability()),
        int8_full_range=full_range_is_exact(),
    )
