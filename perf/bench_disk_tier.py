"""Benchmark: the disk KV tier's reads with each file reader: plain file I/O against NIXL's POSIX
file backend in each of its I/O modes.

A block is one 16-token page of SmolLM2-135M's KV for all 30 layers (float32, shape
``(30, 2, 3, 16, 64)``, 737,280 bytes, a 64-byte header before it); ``--blocks`` distinct random
blocks are written once by a ``DiskTier`` (``backend/engine/disk_tier.py``: ``put`` of every block,
then ``close()``, which waits for the writer thread; timed as "write") into a fresh temporary
folder (``--dir``, default the system's), then read back by a ``DiskTier`` on that folder with
each reader, in turn, ``--repeats`` times, alternating readers: ``read_many`` of as many blocks as
its staging buffer holds (45 here), each block's checksum (XXH3-128) verified in place and the
block copied into a page of a pool-like tensor, as the tiers' loader loads a prompt's prefix.
Two kinds of read:

* **warm**: the files in the page cache (just read), the copy path;
* **cold**: every file dropped from the page cache first (``posix_fadvise(DONTNEED)`` after
  ``sync``: no root needed), so the reads go to the device.

The readers: ``plain file I/O`` (one ``preadv`` per file, ``backend/engine/file_reader.py``) and
``NIXL POSIX (mode)`` (``fabric_bridge/file_reader.py``: the files registered as ``FILE`` memory
and read in one NIXL transfer, for each of ``posix_aio``, ``uring``, ``aio``; a mode the machine
refuses records its error). Each read-back is checked against what was written (``torch.equal``, outside the timings).
MB/s are payload bytes (1e6) per second; reads: the median over the repeats (and the best); the
checksum alone (XXH3-128 against the SHA-256 of the format before) is timed on one block.
Prints a markdown table and writes ``disk-tier.json`` and ``disk-tier.md`` to the results folder
(``perf/results/``).

    python -m perf.bench_disk_tier [--blocks 256] [--repeats 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

from backend.engine.disk_tier import DiskTier
from backend.engine.file_reader import FileReader, PlainFileReader
from fabric_bridge.file_reader import MODES, NixlFileReader
from perf.lib.machine import cpu_model
from perf.lib.results import results_dir

BLOCK_SHAPE = (30, 2, 3, 16, 64)  # SmolLM2-135M: layers, K/V, KV heads, 16-token page, head_dim
DTYPE = torch.float32
XFER_TIMEOUT_S = 120.0


def block_bytes() -> int:
    return int(torch.empty(BLOCK_SHAPE, dtype=DTYPE).nbytes)


def keys(n: int) -> list[bytes]:
    return [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(n)]


def fs_type(path: Path) -> str:
    """The file system ``path`` is on (the longest mount point above it in /proc/mounts)."""
    path = path.resolve()
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and (path == Path(parts[1]) or Path(parts[1]) in path.parents):
                if len(parts[1]) >= len(best):
                    best, kind = parts[1], f"{parts[2]} ({parts[0]} on {parts[1]})"
    except OSError:
        pass
    return kind


# ---------------------------------------------------------------- the ways
def write_blocks(blocks: torch.Tensor, names: list[bytes], root: Path) -> tuple[float, DiskTier]:
    tier = DiskTier(root=root, capacity_bytes=1 << 50, salt=b"bench", layout={}, block_shape=BLOCK_SHAPE, dtype=DTYPE)
    start = time.perf_counter()
    for key, block in zip(names, blocks):
        tier.put(key, block, wait_s=XFER_TIMEOUT_S)  # wait rather than drop when the queue is full
    tier.close(timeout_s=XFER_TIMEOUT_S)
    write_s = time.perf_counter() - start
    stats = tier.stats()
    if stats["writes"] != len(names) or stats["dropped"]:
        raise RuntimeError(f"DiskTier wrote {stats['writes']} of {len(names)} blocks ({stats['dropped']} dropped)")
    return write_s, tier


def drop_from_page_cache(folder: Path) -> None:
    os.sync()
    for path in folder.glob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(tier: DiskTier, names: list[bytes], pages: torch.Tensor) -> float:
    """Every block read back in the loader's batches and copied into ``pages`` (as the loader
    copies into the pool's); the seconds it took."""
    start = time.perf_counter()
    for at in range(0, len(names), tier.batch_blocks):
        for i, block in enumerate(tier.read_many(names[at : at + tier.batch_blocks])):
            if block is not None:
                pages[at + i].copy_(block)
    return time.perf_counter() - start


def checksum_ms() -> dict:
    payload = os.urandom(block_bytes())
    out = {}
    for name, fn in (
        ("xxh3_128", lambda: xxhash.xxh3_128_digest(payload)),
        ("sha256", lambda: hashlib.sha256(payload).digest()),
    ):
        fn()
        start = time.perf_counter()
        for _ in range(50):
            fn()
        out[name] = 1e3 * (time.perf_counter() - start) / 50
    return out


# ---------------------------------------------------------------- report
def table(rows: dict[str, dict], write_mb_s: float) -> str:
    lines = [
        "| reader | warm read MB/s | warm ms/block | cold read MB/s | cold ms/block | read-back matched |",
        "|---|---|---|---|---|---|",
    ]
    for way, r in rows.items():
        if "error" in r:
            error = " ".join(r["error"].split()).replace("|", "/")  # one table cell
            lines.append(f"| {way} | error: {error} | | | | |")
            continue
        cells = []
        for kind in ("warm", "cold"):
            k = r[kind]
            cells += [f"{k['mb_s']:.0f} (best {k['best_mb_s']:.0f})", f"{k['ms_per_block']:.3f}"]
        lines.append(f"| {way} | {' | '.join(cells)} | {'yes' if r['matched'] else 'NO'} |")
    return "\n".join(lines) + f"\n\nwrite (DiskTier's writer thread, plain file I/O): {write_mb_s:.0f} MB/s"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=256, help="KV blocks written and read (default 256)")
    p.add_argument("--repeats", type=int, default=5, help="reads per reader and kind, median reported (default 5)")
    p.add_argument("--dir", default=None, help="where the temporary folder goes (default the system's temp folder)")
    args = p.parse_args(argv)
    if args.blocks < 1 or args.repeats < 1:
        p.error("--blocks and --repeats must be positive")
    base = Path(args.dir or tempfile.gettempdir())
    torch.manual_seed(0)
    blocks = torch.randn(args.blocks, *BLOCK_SHAPE, dtype=DTYPE)
    names = keys(args.blocks)
    mb = args.blocks * block_bytes() / 1e6

    root = Path(tempfile.mkdtemp(prefix="bench_disk_tier_", dir=base))
    rows: dict[str, dict] = {}
    tiers: dict[str, DiskTier] = {}
    batch = 0
    try:
        write_s, writer = write_blocks(blocks, names, root)
        folder, batch = writer.folder, writer.batch_blocks
        readers: dict[str, Callable[[], FileReader]] = {"plain file I/O": PlainFileReader}
        readers.update({f"NIXL POSIX ({m})": (lambda m=m: NixlFileReader(m)) for m in MODES})
        for way, make in readers.items():
            try:
                reader = make()
            except Exception as e:  # the row records why this reader cannot start here
                rows[way] = {"error": f"{type(e).__name__}: {e}"}
                continue
            tiers[way] = DiskTier(root, 1 << 50, b"bench", {}, BLOCK_SHAPE, DTYPE, reader=reader)
        times: dict[str, dict[str, list[float]]] = {way: {"warm": [], "cold": []} for way in tiers}
        matched = dict.fromkeys(tiers, True)
        for _ in range(args.repeats):
            for way, tier in tiers.items():  # alternated: each repeat reads with every reader in turn
                for kind in ("cold", "warm"):
                    if kind == "cold":
                        drop_from_page_cache(folder)
                    pages = torch.zeros_like(blocks)
                    times[way][kind].append(read_all(tier, names, pages))
                    matched[way] &= torch.equal(pages, blocks)
        for way, tier in tiers.items():
            if tier.reader.name != way:  # it failed and gave way to plain file I/O: say so
                rows[way] = {"error": f"fell back to {tier.reader.name} (see the log)"}
                continue
            row: dict = {"matched": matched[way]}
            for kind, ts in times[way].items():
                row[kind] = {
                    "mb_s": mb / statistics.median(ts),
                    "best_mb_s": mb / min(ts),
                    "ms_per_block": 1e3 * statistics.median(ts) / args.blocks,
                    "seconds": ts,
                }
            rows[way] = row
    finally:
        for tier in tiers.values():
            tier.close()
        shutil.rmtree(root, ignore_errors=True)

    checks = checksum_ms()
    head = (
        f"{args.blocks} KV blocks of {block_bytes():,} bytes ({mb:.0f} MB) {'x'.join(map(str, BLOCK_SHAPE))} "
        f"float32, read by the disk tier in batches of {min(args.blocks, batch)}, median of "
        f"{args.repeats} (readers alternated); files on {fs_type(base)}; cold: dropped from the page cache "
        f"first; CPU: {cpu_model()}. Checksum of one block: XXH3-128 {checks['xxh3_128']:.3f} ms "
        f"(SHA-256, the format before: {checks['sha256']:.3f} ms)"
    )
    md = head + "\n\n" + table(rows, mb / write_s) + "\n"
    result = {
        "blocks": args.blocks,
        "block_bytes": block_bytes(),
        "block_shape": list(BLOCK_SHAPE),
        "repeats": args.repeats,
        "dir": str(base),
        "filesystem": fs_type(base),
        "cpu": cpu_model(),
        "write_mb_s": mb / write_s,
        "checksum_ms": checks,
        "ways": rows,
    }
    out = results_dir()
    (out / "disk-tier.json").write_text(json.dumps(result, indent=2))
    (out / "disk-tier.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
