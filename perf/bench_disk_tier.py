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
Writes, the same way alternated: each block encoded (header and checksum) and written as the tier
writes it (a file under a temporary name, renamed into place) with plain file I/O (``write``, as
``DiskTier`` does) and through NIXL's POSIX backend (``posix_aio``: the file registered as
``FILE`` memory, one ``WRITE`` from a registered staging buffer), into the page cache (a fresh
folder each round, removed after it); ms per block, median over the repeats; every file written
is read back and compared.
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
from backend.engine.kv_block import BlockCodec
from fabric_bridge import nixl_api
from fabric_bridge.file_reader import MODES, POLL_S, NixlFileReader
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


class PlainWrites:
    """A block file as ``DiskTier`` writes it: ``write`` of the header and the payload."""

    name = "plain file I/O"

    def write(self, fd: int, header: bytes, payload: memoryview) -> None:
        with os.fdopen(os.dup(fd), "wb") as f:
            f.write(header)
            f.write(payload)

    def close(self) -> None:
        pass


class NixlWrites:
    """The same file written through NIXL's POSIX backend: header and payload copied into a
    registered staging buffer, the file registered as ``FILE`` memory, one ``WRITE``."""

    def __init__(self, size: int, mode: str = "posix_aio"):
        self.name = f"NIXL POSIX ({mode})"
        api = nixl_api.load()
        config = api.nixl_agent_config(enable_prog_thread=False, backends=[])
        self.agent = api.nixl_agent(f"bench-disk-write-{os.getpid()}", config)
        self.agent.create_backend("POSIX", {MODES[mode]: "true"})
        self.stage = torch.empty(size, dtype=torch.uint8)
        self.stage_reg = self.agent.register_memory(self.stage, backends=["POSIX"])
        self.size = size

    def write(self, fd: int, header: bytes, payload: memoryview) -> None:
        view = self.stage.numpy().data.cast("B")
        view[: len(header)] = header
        view[len(header) :] = payload
        agent, size = self.agent, self.size
        files = agent.register_memory([(0, size, fd, "")], "FILE", backends=["POSIX"])
        try:
            handle = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs([(self.stage.data_ptr(), size, 0)], "DRAM"),
                agent.get_xfer_descs([(0, size, fd)], "FILE"),
                agent.name,
                backends=["POSIX"],
            )
            try:
                state, deadline = agent.transfer(handle), time.monotonic() + XFER_TIMEOUT_S
                while state == "PROC" and time.monotonic() < deadline:
                    time.sleep(POLL_S)
                    state = agent.check_xfer_state(handle)
                if state != "DONE":
                    raise OSError(f"NIXL POSIX write ended in state {state!r}")
            finally:
                agent.release_xfer_handle(handle)
        finally:
            agent.deregister_memory(files, backends=["POSIX"])

    def close(self) -> None:
        self.agent.deregister_memory(self.stage_reg, backends=["POSIX"])


def write_round(way, codec: BlockCodec, blocks: torch.Tensor, names: list[bytes], folder: Path) -> tuple[float, bool]:
    """Every block encoded and written into ``folder`` by ``way`` (a temporary name, renamed);
    the seconds it took, and whether every file reads back as written."""
    folder.mkdir()
    start = time.perf_counter()
    for key, block in zip(names, blocks):
        header, payload = codec.encode_parts(key, block)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=folder)
        try:
            way.write(fd, header, payload)
        finally:
            os.close(fd)
        os.replace(tmp, folder / f"{key.hex()}.kv")
    seconds = time.perf_counter() - start
    matched = all(
        (folder / f"{key.hex()}.kv").read_bytes() == codec.encode(key, block) for key, block in zip(names, blocks)
    )
    shutil.rmtree(folder)
    return seconds, matched


def compare_writes(blocks: torch.Tensor, names: list[bytes], root: Path, repeats: int) -> dict[str, dict]:
    """ms per block written, per way (alternated rounds), or why a way cannot run here."""
    codec = BlockCodec(b"\0" * 16, BLOCK_SHAPE, DTYPE)
    ways: dict = {"plain file I/O": PlainWrites()}
    rows: dict[str, dict] = {}
    try:
        ways["NIXL POSIX (posix_aio)"] = NixlWrites(codec.size)
    except Exception as e:  # the row records why NIXL cannot write here
        rows["NIXL POSIX (posix_aio)"] = {"error": f"{type(e).__name__}: {e}"}
    times: dict[str, list[float]] = {name: [] for name in ways}
    matched = dict.fromkeys(ways, True)
    try:
        for r in range(repeats):
            for i, (name, way) in enumerate(ways.items()):
                seconds, ok = write_round(way, codec, blocks, names, root / f"writes-{r}-{i}")
                times[name].append(seconds)
                matched[name] &= ok
    finally:
        for way in ways.values():
            way.close()
    for name, ts in times.items():
        rows[name] = {
            "matched": matched[name],
            "ms_per_block": 1e3 * statistics.median(ts) / len(names),
            "best_ms_per_block": 1e3 * min(ts) / len(names),
            "seconds": ts,
        }
    return rows


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
def table(rows: dict[str, dict], write_mb_s: float, writes: dict[str, dict]) -> str:
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
    lines += [
        "",
        f"write (DiskTier's writer thread, plain file I/O): {write_mb_s:.0f} MB/s",
        "",
        "| writer (into the page cache) | ms/block (median) | best | written as read back |",
        "|---|---|---|---|",
    ]
    for way, r in writes.items():
        if "error" in r:
            lines.append(f"| {way} | error: {' '.join(r['error'].split()).replace('|', '/')} | | |")
        else:
            ok = "yes" if r["matched"] else "NO"
            lines.append(f"| {way} | {r['ms_per_block']:.3f} | {r['best_ms_per_block']:.3f} | {ok} |")
    return "\n".join(lines)


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
        writes = compare_writes(blocks, names, root, args.repeats)
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
    md = head + "\n\n" + table(rows, mb / write_s, writes) + "\n"
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
        "writes": writes,
    }
    out = results_dir()
    (out / "disk-tier.json").write_text(json.dumps(result, indent=2))
    (out / "disk-tier.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
