"""Our products with weights held in groups of 32 along the input dimension (the int4w format's
4-bit groups, GGUF Q4_1's block, and its LM head's 8-bit groups, GGUF Q8_0's block), through our
own kernel (``kernels/group_matmul.c``; ``threads`` split each product's output rows: the calling
thread and helper threads of the library's own, which spin for 0.2 ms after a product for the
next one, then sleep).

The kernel quantizes the activations per row and group of 32 to int16 (scale: the group's largest
magnitude over 32767; the error of each value at most 1.5e-5 of that magnitude, finer than float16's
rounding) and sums each group's integer products exactly in int32, scaled once in float32. Two
layouts of the same groups, each with its kernel: rows in order (AVX2 and FMA, any CPU the format
runs on) and tiles of 16 rows (AVX-512 VNNI: a 512-bit register sums 16 outputs at once, 16
``vpdpwssd`` per group), chosen once per process (:func:`tiles_available`). Against converting
every weight to float32 (the kernel before them), SmolLM2-135M's 120 layer shapes at one row took
5.4 ms instead of 9.2 with their weights in the cache (Intel Xeon family 6 model 167, one thread,
rows in order); on the model's own weights, read from memory, 11.7 ms: one core's memory
bandwidth is the bound there. The tiles pay off with more rows (measurements in
``group_linear.py``). Held-out quality as float32's (``tests/integration/test_int4w_quality.py``).

The kernel is compiled once per source and CPU (``cc -O3 -mavx2 -mfma``) into the user's cache
(``TRITON_DISAGG_CACHE``, default ``~/.cache/triton-disagg``) and loaded with ctypes (the GIL is
released during the call); without a C compiler the formats that need it are refused at load with
the reason.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from backend.engine.cpu_kernels import group_tiles

log = logging.getLogger("triton_disagg.engine")

GROUP = 32
TILE = 16  # rows of W per tile (the AVX-512 VNNI kernel)
SOURCE = Path(__file__).with_name("kernels") / "group_matmul.c"
CFLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
LIBS = ("-lm", "-lpthread")


def cache_dir() -> Path:
    return Path(os.environ.get("TRITON_DISAGG_CACHE") or Path.home() / ".cache" / "triton-disagg") / "kernels"


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernel library (built on first use, then loaded from the cache)."""
    source = SOURCE.read_bytes()
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(source + " ".join((compiler, *CFLAGS, *LIBS, platform.machine())).encode()).hexdigest()[:16]
    lib_path = cache_dir() / f"group_matmul-{key}.so"
    if not lib_path.is_file():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)
        os.close(fd)
        try:
            done = subprocess.run(
                [compiler, *CFLAGS, "-o", tmp, str(SOURCE), *LIBS], capture_output=True, text=True, timeout=120
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            os.unlink(tmp)
            raise RuntimeError(f"group kernels: cannot compile {SOURCE.name} with {compiler!r}: {e}") from None
        if done.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"group kernels: compiling {SOURCE.name} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, lib_path)  # atomic: processes that build at once load a whole file
        log.info("group kernels: compiled %s into %s", SOURCE.name, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    lib.int4_matmul.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 5
    lib.int4_matmul.restype = ctypes.c_int
    lib.int8_matmul.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 5
    lib.int8_matmul.restype = ctypes.c_int
    lib.tiles_supported.argtypes = []
    lib.tiles_supported.restype = ctypes.c_int
    return lib


@functools.cache
def tiles_available() -> bool:
    """Whether this process's products take the tiles of 16 rows (``cpu_kernels.group_tiles``: the
    CPU's AVX-512 VNNI, unless ``TRITON_DISAGG_KERNELS=avx2``; the compiled library agrees)."""
    return group_tiles() and bool(library().tiles_supported())


def _checked(rc: int) -> None:
    if rc == -2:
        raise ValueError("group kernels: tiles of 16 rows need N a multiple of 16 and a CPU with AVX-512 VNNI")
    if rc != 0:
        raise MemoryError("group kernels: no memory for the activations' int16 copy")


def int4_product(
    packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, rows: torch.Tensor, threads: int = 1, tiled: bool = False
) -> torch.Tensor:
    """``rows`` [M, K] float32 (contiguous) times the 4-bit groups (:func:`quantize_int4`, in the
    layout ``tiled`` names): [M, N]."""
    n, k = d.numel() * GROUP // rows.shape[1], rows.shape[1]
    out = torch.empty(rows.shape[0], n)
    _checked(
        library().int4_matmul(
            packed.data_ptr(),
            d.data_ptr(),
            m.data_ptr(),
            rows.data_ptr(),
            out.data_ptr(),
            rows.shape[0],
            n,
            k,
            threads,
            int(tiled),
        )
    )
    return out


def int8_product(
    q: torch.Tensor, d: torch.Tensor, rows: torch.Tensor, threads: int = 1, tiled: bool = False
) -> torch.Tensor:
    """``rows`` [M, K] float32 (contiguous) times the 8-bit groups (:func:`quantize_int8`, in the
    layout ``tiled`` names): [M, N]."""
    k = rows.shape[1]
    n = q.numel() // k
    out = torch.empty(rows.shape[0], n)
    _checked(
        library().int8_matmul(
            q.data_ptr(), d.data_ptr(), rows.data_ptr(), out.data_ptr(), rows.shape[0], n, k, threads, int(tiled)
        )
    )
    return out


def _groups(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"{fmt}: in_features {k} is not a multiple of {GROUP}")
    return weight.detach().float().reshape(n, k // GROUP, GROUP)


def _tile_scales(scales: torch.Tensor) -> torch.Tensor:
    """[N, G] -> the tiles' [N / 16, G, 16]: a group's scales for a tile's 16 rows side by side."""
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


def quantize_int4(weight: torch.Tensor, tiled: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """``weight`` [N, K] (K a multiple of 32) as (packed nibbles, d, m, the largest error relative
    to its group's range: 0.0 when every group is exact). Per group: ``m`` its minimum, ``d`` the
    range over 15 rounded to float16 (as GGUF's Q4_1). Rows in order (``tiled`` False): nibbles
    [N, K/2] (group g's 16 bytes: weight j in the low nibble of byte j, weight j + 16 in its high
    one), d and m [N, K/32]; tiles of 16 rows (N a multiple of 16): the kernel's tile layout."""
    n, k = weight.shape
    groups = _groups(weight, "int4w")
    low, high = groups.amin(-1), groups.amax(-1)
    d = ((high - low) / 15).half().float()
    q = torch.round((groups - low[..., None]) / torch.where(d == 0, 1.0, d)[..., None]).clamp(0, 15)
    error = ((q * d[..., None] + low[..., None]) - groups).abs().amax(-1) / (high - low).clamp_min(1e-30)
    worst = float(error.max()) if error.numel() else 0.0
    nibbles = q.to(torch.uint8)
    if not tiled:
        packed = (nibbles[..., :16] | (nibbles[..., 16:] << 4)).reshape(n, k // 2).contiguous()
        return packed, d.contiguous(), low.contiguous(), worst
    _tile_rows(n)
    row, index = _tile_nibbles()
    by_tile = nibbles.view(n // TILE, TILE, k // GROUP, GROUP).transpose(1, 2)  # [tiles, G, 16, 32]
    values = by_tile[:, :, row, index]  # [tiles, G, 4, 64, 2]
    packed = (values[..., 0] | (values[..., 1] << 4)).reshape(n, k // 2).contiguous()
    return packed, _tile_scales(d), _tile_scales(low), worst


def _tile_rows(n: int) -> None:
    if n % TILE:
        raise ValueError(f"group tiles: {n} output rows is not a multiple of {TILE}")


def quantize_int8(weight: torch.Tensor, tiled: bool = False) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``weight`` [N, K] (K a multiple of 32) as (q, d, the largest error relative to its group's
    largest magnitude: 0.0 when every group is exact). Per group: ``d`` the largest magnitude over
    127 (as GGUF's Q8_0, whose values this recovers exactly). Rows in order: q [N, K] int8, d
    [N, K/32]; tiles of 16 rows (N a multiple of 16): the kernel's tile layout."""
    n, k = weight.shape
    groups = _groups(weight, "int8 groups")
    amax = groups.abs().amax(-1)
    d = amax / 127
    q = torch.round(groups / torch.where(d == 0, 1.0, d)[..., None]).clamp(-127, 127).to(torch.int8)
    error = (q * d[..., None] - groups).abs().amax(-1) / amax.clamp_min(1e-30)
    worst = float(error.max()) if error.numel() else 0.0
    if not tiled:
        return q.reshape(n, k).contiguous(), d.contiguous(), worst
    _tile_rows(n)
    # [tiles, 16 rows, G, 16 pair steps, 2] -> [tiles, G, steps, rows, 2]
    tiles = q.view(n // TILE, TILE, k // GROUP, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
    return tiles.reshape(n, k).contiguous(), _tile_scales(d), worst
