"""The CPU's roofs for the group kernel's products: multiply-adds per second per core of each
instruction they are made of, and bytes per second its cores read from memory (``vector_peak.c``,
compiled here with ``cc``); from them, the least time a decode step's products can take at a
number of rows (``roof_ms``): their multiply-adds at the peak, or their weights' bytes read once,
whichever takes longer. Used by ``bench group-kernels`` to say how close each kernel version is to
what the CPU can do, and what bounds it."""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from backend.engine.cpu_kernels import GROUP_VNNI_FLAGS

# instruction -> (multiply-adds per instruction, CPU flags it needs: the kernel version's that uses it)
INSTRUCTIONS = {"vpdpwssd_zmm": (32, GROUP_VNNI_FLAGS), "vpmaddwd_ymm": (16, ("avx2",))}
ROUND = 12  # instructions a round of vector_peak.c's loops (its 12 independent sums)

# a kernel version (bench group-kernels' names) -> the instruction of its 4-bit products and of its
# 8-bit ones (the LM head: 16-bit activations in every version)
VERSION_INSTRUCTIONS = {"avx512_vnni": ("vpdpwssd_zmm", "vpdpwssd_zmm"), "avx2": ("vpmaddwd_ymm", "vpmaddwd_ymm")}


def _library(folder: Path) -> ctypes.CDLL:
    source = Path(__file__).with_name("vector_peak.c")
    out = folder / "vector_peak.so"
    subprocess.run(
        [os.environ.get("CC", "cc"), "-O3", "-shared", "-fPIC", str(source), "-o", str(out)],
        check=True,
        capture_output=True,
    )
    lib = ctypes.CDLL(str(out))
    for name in INSTRUCTIONS:
        getattr(lib, name).restype = ctypes.c_double
        getattr(lib, name).argtypes = [ctypes.c_long, ctypes.POINTER(ctypes.c_long)]
    lib.read_pass.restype = ctypes.c_double
    lib.read_pass.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.POINTER(ctypes.c_long)]
    return lib


def peaks(cpu_flags: set[str], threads: int = 1, seconds: float = 0.2, repeats: int = 5) -> dict[str, float]:
    """Multiply-adds per second of each instruction this CPU has, on ``threads`` cores at once
    (each thread its own loop; ctypes lets go of the GIL), best of ``repeats`` (the machine is
    shared: a neighbour's load only ever lowers a figure)."""
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        lib = _library(Path(tmp))
        for name, (macs, needs) in INSTRUCTIONS.items():
            if not set(needs) <= cpu_flags:
                continue
            fn = getattr(lib, name)
            iters = max(1000, int(seconds / fn(100000, ctypes.byref(ctypes.c_long())) * 100000))
            fastest = min(
                _together(threads, lambda i, f=fn, n=iters: f(n, ctypes.byref(ctypes.c_long()))) for _ in range(repeats)
            )
            result[name] = threads * iters * ROUND * macs / fastest
    return result


def read_bandwidth(threads: int = 1, megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second ``threads`` cores read from memory at once, each its share of a buffer of
    ``megabytes`` (written first: untouched pages would all read one zero page; larger than the
    caches, as a decode step's weights are), best of ``repeats``."""
    share = (megabytes << 20) // threads // 256 * 256
    buffer = ctypes.create_string_buffer(threads * share + 64)
    start = (ctypes.addressof(buffer) + 63) // 64 * 64
    ctypes.memset(start, 1, threads * share)
    with tempfile.TemporaryDirectory() as tmp:
        lib = _library(Path(tmp))
        fastest = min(
            _together(threads, lambda i: lib.read_pass(start + i * share, share, ctypes.byref(ctypes.c_long())))
            for _ in range(repeats)
        )
    return threads * share / fastest


def _together(threads: int, one: Callable[[int], float]) -> float:
    """The most seconds ``one(i)`` reports for thread i of ``threads`` run at once (ctypes lets go
    of the GIL)."""
    took = [0.0] * threads

    def run(i: int) -> None:
        took[i] = one(i)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return max(took)


def roof_ms(
    version: str, rows: int, macs_4bit: int, macs_8bit: int, peak: dict[str, float], step_bytes: int, bandwidth: float
) -> tuple[float, str] | None:
    """The least time (ms) ``version`` can make a step's products in at ``rows`` rows, and what
    bounds it: their multiply-adds at its instructions' peak ("arithmetic"), or the weights'
    ``step_bytes`` read once at ``bandwidth`` bytes/s ("memory"), whichever is longer (None where
    the CPU lacks an instruction)."""
    four, eight = VERSION_INSTRUCTIONS[version]
    if four not in peak or eight not in peak:
        return None
    arithmetic = 1e3 * rows * (macs_4bit / peak[four] + macs_8bit / peak[eight])
    memory = 1e3 * step_bytes / bandwidth
    return (arithmetic, "arithmetic") if arithmetic >= memory else (memory, "memory")
