"""Our products with weights held in groups of 32 along the input dimension (the int4w format's
4-bit groups, GGUF Q4_1's block, and its LM head's 8-bit groups, GGUF Q8_0's block), through our
own kernel library (``kernels/``: one library of several files, ``kernels/group_matmul.h`` says
which; ``threads`` split each product's output rows: the calling thread and helper threads of the
library's own (``threads.c``), which spin for 0.2 ms after a product for the next one, then
sleep; each thread takes its own share, then what the others have not taken yet).

The kernel quantizes the activations per row and group of 32 to int16 (scale: the group's largest
magnitude over 32767; the error of each value at most 1.5e-5 of that magnitude, finer than float16's
rounding) and sums each group's integer products exactly in int32, scaled once in float32. The
weights are held in tiles of 16 rows (:class:`Groups`; N padded to a multiple of 16), which two
kernels read: AVX-512 VNNI (16 outputs per 512-bit register, 16 ``vpdpwssd`` per group) and AVX2
(two halves of 8 rows, ``vpmaddwd``), chosen once per process (:func:`kernel`). Measured on
SmolLM2-135M's 121 decode-step products (its own weights, read from memory; Intel Xeon family 6
model 167, 2 threads): 1 row 5.7 ms (VNNI) / 6.4 (AVX2), 8 rows 13.8 / 20.0, against 8.2 and
30.8 for the AVX2 kernel over rows in order that they replaced (``perf`` history, 2026-12-05).
Held-out quality as float32's (``tests/integration/test_int4w_quality.py``).

The library is compiled once per source and CPU (``cc -O3 -mavx2 -mfma -mf16c``: each ``.c`` file
of ``kernels/`` at once, one compiler per file and core, then linked: one library, one dispatch
table) into the user's cache
(``TRITON_DISAGG_CACHE``, default ``~/.cache/triton-disagg``) and loaded with ctypes (the GIL is
released during the call); without a C compiler the formats that need it are refused at load with
the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.engine.config import cache_root
from backend.engine.cpu_kernels import group_kernel
from backend.engine.formats import FEW_ROWS

log = logging.getLogger("triton_disagg.engine")

GROUP = 32
TILE = 16  # rows of W per tile
# the most rows a product takes through the float32 / float16 products (f32_product), the
# registry's few-row limit: measured faster than MKL's float32 products up to here on 2 threads
# (small_batch_linear.py's docstring)
FLOAT_ROWS = FEW_ROWS
KERNELS = {"avx2": 1, "avx512_vnni": 2}  # the library's kernel numbers
KERNELS_DIR = Path(__file__).with_name("kernels")
SOURCE = KERNELS_DIR / "group_matmul.c"  # the library's entry points and dispatch table


def sources() -> list[Path]:
    """The library's C files, compiled together (sorted: the build key and the command are stable)."""
    return sorted(KERNELS_DIR.glob("*.c"))


def headers() -> list[Path]:
    return sorted(KERNELS_DIR.glob("*.h"))


CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC")
LIBS = ("-lm", "-lpthread")
COMPILE_TIMEOUT_S = 600


def cache_dir() -> Path:
    return cache_root() / "kernels"


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernel library (built on first use, then loaded from the cache): :func:`build`."""
    return build()


def build(defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernel library compiled with ``defines`` (``-DNAME=VALUE``: the source's test hooks;
    none in serving: ``kernels/test_hooks.h``), built on first use, then loaded from the cache.
    A cached build is named by its sources, compiler, flags, defines and architecture and by the
    SHA-256 of its own bytes: one whose bytes do not hash to its name (truncated, altered) or that
    does not load is logged, removed and built again, never loaded."""
    compiler = os.environ.get("CC", "cc")
    key = build_key(compiler, defines)
    folder = cache_dir()
    for cached in sorted(folder.glob(f"group_matmul-{key}-*.so")):
        lib = _load_cached(cached)
        if lib is not None:
            return _typed(lib)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        _compile(compiler, defines, tmp)
    except BaseException:
        os.unlink(tmp)
        raise
    lib_path = folder / f"group_matmul-{key}-{_digest(Path(tmp))}.so"
    os.replace(tmp, lib_path)  # atomic: processes that build at once load a whole file
    log.info("group kernels: compiled %s into %s", " ".join(p.name for p in sources()), lib_path)
    return _typed(ctypes.CDLL(str(lib_path)))


def _compile(compiler: str, defines: tuple[str, ...], out: str) -> None:
    """The sources compiled into objects at once (one compiler per file, as many at a time as
    there are cores: the files take 1-3 s each at -O3), then linked into the library ``out``."""
    with tempfile.TemporaryDirectory(dir=Path(out).parent) as work:
        objects = [str(Path(work) / f"{source.stem}.o") for source in sources()]
        commands = [
            [compiler, *CFLAGS, *defines, "-c", "-o", obj, str(source)] for source, obj in zip(sources(), objects)
        ]
        with ThreadPoolExecutor(max(1, min(len(commands), os.cpu_count() or 1))) as pool:
            for source, why in zip(sources(), pool.map(_run, commands)):
                if why:
                    raise RuntimeError(f"group kernels: compiling {source.name} failed: {why}")
        why = _run([compiler, "-shared", "-o", out, *objects, *LIBS])
        if why:
            raise RuntimeError(f"group kernels: linking {SOURCE.stem}.so failed: {why}")


def _run(command: list[str]) -> str | None:
    """``command`` run; None when it succeeded, otherwise why not (the end of its errors)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run {command[0]!r}: {e}"
    if done.returncode == 0:
        return None
    return done.stderr.strip()[-500:] or f"{command[0]} exited with code {done.returncode}, printing nothing"


def build_key(compiler: str, defines: tuple[str, ...] = ()) -> str:
    """What a cached build is named by first: every source and header (name and bytes), the
    compiler, the flags and defines, the architecture."""
    digest = hashlib.sha256()
    for path in (*sources(), *headers()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join((compiler, *CFLAGS, *defines, *LIBS, platform.machine())).encode())
    return digest.hexdigest()[:16]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _load_cached(path: Path) -> ctypes.CDLL | None:
    """``path`` loaded, or None (and the file removed) when its bytes do not hash to its name or
    it does not load."""
    why = None
    try:
        if _digest(path) != path.stem.rsplit("-", 1)[-1]:
            why = "its bytes do not match its name's checksum"
        else:
            return ctypes.CDLL(str(path))
    except OSError as e:
        why = f"it does not load: {e}"
    log.warning("group kernels: cached build %s is damaged (%s); removed, building again", path, why)
    with contextlib.suppress(OSError):
        path.unlink()
    return None


def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with its functions' argument and result types set."""
    lib.int4_matmul.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 5
    lib.int4_matmul.restype = ctypes.c_int
    lib.int8_matmul.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 5
    lib.int8_matmul.restype = ctypes.c_int
    for name in ("f32_matmul", "f16_matmul"):
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 5
        getattr(lib, name).restype = ctypes.c_int
    lib.tiles_supported.argtypes = []
    lib.tiles_supported.restype = ctypes.c_int
    return lib


@functools.cache
def kernel() -> int:
    """The library's kernel for this process's products (:data:`KERNELS`): as
    ``cpu_kernels.group_kernel`` says (AVX-512 VNNI where the CPU has it, unless
    ``TRITON_DISAGG_KERNELS=avx2``), AVX2 where the compiled library cannot run VNNI's."""
    name = group_kernel()
    if name == "avx512_vnni" and not library().tiles_supported():
        log.info("group kernels: the library does not run AVX-512 VNNI here; AVX2")
        name = "avx2"
    return KERNELS[name]


@dataclass(frozen=True)
class Groups:
    """A weight [n, k] held in groups of 32 along k, in the kernels' tiles of 16 rows (rows past n,
    up to a multiple of 16, are zeros): ``q`` the tiles' bytes, ``d`` (and ``m``, 4 bits only) the
    groups' constants [tiles, k / 32, 16] in float16 (as GGUF's blocks hold them), ``error`` the
    largest rounding error relative to its group's range (4 bits) or largest magnitude (8 bits):
    0.0 when every group is exact."""

    bits: int
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    n: int
    k: int
    error: float

    @property
    def padded(self) -> int:
        return self.d.shape[0] * TILE


def _checked(rc: int) -> None:
    if rc == -2:
        raise ValueError("group kernels: N not a multiple of 16, or a kernel this CPU does not run")
    if rc != 0:
        raise MemoryError("group kernels: no memory for the activations' int16 copy")


def product(groups: Groups, rows: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """``rows`` [M, k] float32 (contiguous) times the weight in ``groups``: [M, n]."""
    if rows.shape[1] != groups.k:
        raise ValueError(f"group product: rows of {rows.shape[1]} values against groups of {groups.k}")
    lib, count, padded = library(), rows.shape[0], groups.padded
    out = torch.empty(count, padded)
    ptrs = (groups.q.data_ptr(), groups.d.data_ptr(), rows.data_ptr(), out.data_ptr())
    with profiled(f"group_kernel::int{groups.bits}_matmul"):
        if groups.bits == 4:
            assert groups.m is not None
            rc = lib.int4_matmul(*ptrs[:2], groups.m.data_ptr(), *ptrs[2:], count, padded, groups.k, threads, kernel())
        else:
            rc = lib.int8_matmul(*ptrs, count, padded, groups.k, threads, kernel())
    _checked(rc)
    return out if padded == groups.n else out[:, : groups.n]


def f32_product(weight: torch.Tensor, rows: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """``rows`` [M, k] (float32, contiguous) times ``weight`` [n, k] (float32, or float16 widened
    in registers; contiguous; k a multiple of 16): [M, n], each output one dot product summed in
    float32 (``f32_matmul`` / ``f16_matmul``: the weight read once per 8 rows)."""
    count, n, k = rows.shape[0], weight.shape[0], weight.shape[1]
    out = torch.empty(count, n)
    name = "f16_matmul" if weight.dtype == torch.float16 else "f32_matmul"
    with profiled(f"group_kernel::{name}"):
        call = getattr(library(), name)
        rc = call(weight.data_ptr(), rows.data_ptr(), out.data_ptr(), count, n, k, threads, kernel())
    if rc != 0:
        raise ValueError(f"float kernel: refused a product of {k} inputs (a multiple of 16 only)")
    return out


@functools.cache
def f32_unsupported() -> str | None:
    """None when :func:`f32_product` runs here; else why not (no C compiler, say). The library is
    built here whatever kernel the CPU picks: :func:`kernel` builds it only on the way to the VNNI
    kernel, so on an AVX2-only CPU a missing compiler would otherwise surface only at the first call."""
    try:
        library()
        kernel()
    except (RuntimeError, OSError) as e:
        return str(e)
    return None


def profiled(name: str) -> contextlib.AbstractContextManager:
    """A call into the library as ``name`` for torch's profiler while it runs (``bench engine``'s
    step profile: the kernel's time is not an op's), else nothing (7 us a call saved)."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def dequantize(groups: Groups) -> torch.Tensor:
    """The weight that ``groups`` holds, [n, k] float32 (what the kernels multiply by)."""
    tiles, g = groups.d.shape[0], groups.k // GROUP
    if groups.bits == 4:
        row, index = _tile_nibbles()
        packed = groups.q.view(tiles, g, 4, 64)
        values = torch.stack([packed & 0x0F, packed >> 4], dim=-1)  # [tiles, G, 4, 64, 2]
        q = torch.empty(tiles, g, TILE, GROUP, dtype=torch.uint8)
        q[:, :, row, index] = values
    else:
        q = groups.q.view(tiles, g, GROUP // 2, TILE, 2).permute(0, 1, 3, 2, 4).reshape(tiles, g, TILE, GROUP)
    d = groups.d.float().transpose(1, 2)[..., None]  # [tiles, 16, G, 1]
    w = q.transpose(1, 2).float() * d
    if groups.m is not None:
        w = w + groups.m.float().transpose(1, 2)[..., None]
    return w.reshape(groups.padded, groups.k)[: groups.n]


def _groups(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"{fmt}: in_features {k} is not a multiple of {GROUP}")
    weight = weight.detach().float()
    padded = -(-n // TILE) * TILE
    if padded != n:  # whole tiles: zero rows (their groups: zero constants and values)
        weight = torch.cat([weight, weight.new_zeros(padded - n, k)])
    return weight.reshape(padded, k // GROUP, GROUP)


def _tile_scales(scales: torch.Tensor) -> torch.Tensor:
    """[N, G] -> the tiles' [N / 16, G, 16]: a group's constants for a tile's 16 rows side by side."""
    n, g = scales.shape
    return scales.view(n // TILE, TILE, g).transpose(1, 2).contiguous()


@functools.cache
def _tile_nibbles() -> tuple[torch.Tensor, torch.Tensor]:
    """For the 4-bit tiles: which (row of the tile, weight of the group) each nibble of a group's
    4 chunks of 64 bytes holds, [4, 64, 2] each (the kernel's ``widen4_tile`` undone: byte b of
    a chunk widens into int16 element 8 (b / 16) + b % 8 of pair step 4c + (b % 16) / 8 (low
    nibble) or that + 2 (high nibble); element e of step p is weight 2p + e % 2 of row e / 2)."""
    c = torch.arange(4).view(4, 1, 1)
    b = torch.arange(64).view(1, 64, 1)
    nib = torch.arange(2).view(1, 1, 2)
    step = 4 * c + (b % 16) // 8 + 2 * nib
    element = 8 * (b // 16) + b % 8
    row, weight = element // 2, 2 * step + element % 2
    return row.expand(4, 64, 2).contiguous(), weight.expand(4, 64, 2).contiguous()


def quantize_int4(weight: torch.Tensor) -> Groups:
    """``weight`` [N, K] (K a multiple of 32) as 4-bit groups: per group, ``m`` its minimum and
    ``d`` the range over 15, both rounded to float16 (as GGUF's Q4_1), values ``d * q + m``."""
    n, k = weight.shape
    groups = _groups(weight, "int4w")
    low, high = groups.amin(-1).half().float(), groups.amax(-1)
    d = ((high - low) / 15).half().float()
    q = torch.round((groups - low[..., None]) / torch.where(d == 0, 1.0, d)[..., None]).clamp(0, 15)
    error = ((q * d[..., None] + low[..., None]) - groups).abs().amax(-1) / (high - low).clamp_min(1e-30)
    padded = groups.shape[0]
    row, index = _tile_nibbles()
    by_tile = q.to(torch.uint8).view(padded // TILE, TILE, k // GROUP, GROUP).transpose(1, 2)  # [tiles, G, 16, 32]
    values = by_tile[:, :, row, index]  # [tiles, G, 4, 64, 2]
    packed = (values[..., 0] | (values[..., 1] << 4)).reshape(padded, k // 2).contiguous()
    worst = float(error[:n].max()) if n and k else 0.0
    return Groups(4, packed, _tile_scales(d.half()), _tile_scales(low.half()), n, k, worst)


def quantize_int8(weight: torch.Tensor) -> Groups:
    """``weight`` [N, K] (K a multiple of 32) as 8-bit groups: per group, ``d`` the largest
    magnitude over 127 rounded to float16 (as GGUF's Q8_0, whose values this recovers exactly),
    values ``d * q``."""
    n, k = weight.shape
    groups = _groups(weight, "int8 groups")
    amax = groups.abs().amax(-1)
    d = (amax / 127).half().float()
    q = torch.round(groups / torch.where(d == 0, 1.0, d)[..., None]).clamp(-127, 127).to(torch.int8)
    error = (q * d[..., None] - groups).abs().amax(-1) / amax.clamp_min(1e-30)
    padded = groups.shape[0]
    # [tiles, 16 rows, G, 16 pair steps, 2] -> [tiles, G, steps, rows, 2]
    tiles = q.view(padded // TILE, TILE, k // GROUP, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
    worst = float(error[:n].max()) if n and k else 0.0
    return Groups(8, tiles.reshape(padded, k).contiguous(), _tile_scales(d.half()), None, n, k, worst)
