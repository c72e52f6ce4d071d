"""Benchmark: KV blocks between host memory and files, the disk tier's plain file I/O vs NIXL's POSIX backend.

A block is one 16-token page of SmolLM2-135M's KV for all 30 layers (float32, shape
``(30, 2, 3, 16, 64)``, 737,280 bytes); ``--blocks`` distinct random blocks are moved two ways,
side by side in one run, into a fresh temporary folder (``--dir``, default the system's) each
repeat:

* ``DiskTier`` (``backend/engine/disk_tier.py``), as the engine uses it: write = ``put`` of every
  block then ``close()`` (waits for the writer thread), timed as a whole; one file a block, each
  encoded (header, SHA-256 checksum), written under another name and renamed into place. Read =
  ``read`` of every block (read in place into one buffer, checksum verified).
* NIXL's POSIX file backend (``nixl_cu12``): one file a block, raw payload at offset 0. The
  blocks' DRAM (one tensor) and the files (``FILE`` descriptors ``(offset, length, fd)``) are
  registered once, outside the timings; write = one ``initialize_xfer("WRITE", DRAM descs, FILE
  descs, own agent)`` of all blocks, ``transfer`` and ``check_xfer_state`` until ``DONE``; read =
  the same with ``"READ"`` into a zeroed DRAM buffer. The prepare (``initialize_xfer``) is inside
  the timings and also reported alone.

Reads find the files in the page cache (just written), so they measure the copy path, not the
device. Each way's read-back is checked against what was written (``torch.equal``). MB/s are
payload bytes (1e6) per second, best of ``--repeats``; "ms/block read" is the best read time over
the blocks. If NIXL or its POSIX backend cannot start, or a transfer fails, its row records the
error and the DiskTier row is still reported. Prints a markdown table and writes
``disk-tier.json`` and ``disk-tier.md`` to the results folder (``perf/results/``).

    python -m perf.bench_disk_tier [--blocks 256] [--repeats 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from backend.engine.disk_tier import DiskTier
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


# ---------------------------------------------------------------- DiskTier
def disk_tier_once(blocks: torch.Tensor, names: list[bytes], root: Path) -> dict:
    tier = DiskTier(root=root, capacity_bytes=1 << 50, salt=b"bench", layout={}, block_shape=BLOCK_SHAPE, dtype=DTYPE)
    start = time.perf_counter()
    for key, block in zip(names, blocks):
        tier.put(key, block, wait_s=XFER_TIMEOUT_S)  # wait rather than drop when the queue is full
    tier.close(timeout_s=XFER_TIMEOUT_S)
    write_s = time.perf_counter() - start
    stats = tier.stats()
    if stats["writes"] != len(names) or stats["dropped"]:
        raise RuntimeError(f"DiskTier wrote {stats['writes']} of {len(names)} blocks ({stats['dropped']} dropped)")
    read = []
    start = time.perf_counter()
    for key in names:
        read.append(tier.read(key))
    read_s = time.perf_counter() - start
    matched = all(r is not None and torch.equal(r, b) for r, b in zip(read, blocks))
    return {"write_s": write_s, "read_s": read_s, "matched": matched}


# ---------------------------------------------------------------- NIXL POSIX
def _wait(agent, handle, what: str) -> None:
    state = agent.transfer(handle)
    deadline = time.monotonic() + XFER_TIMEOUT_S
    while state == "PROC":
        if time.monotonic() > deadline:
            raise TimeoutError(f"NIXL {what} not done after {XFER_TIMEOUT_S:.0f} s")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL {what} ended in state {state!r}")


def nixl_once(agent, blocks: torch.Tensor, folder: Path) -> dict:
    """One repeat: N files in ``folder``, all blocks written in one xfer, read back in another."""
    n, size = blocks.shape[0], block_bytes()
    back = torch.zeros_like(blocks)
    fds = [os.open(folder / f"{i:06d}.kv", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644) for i in range(n)]
    regs = []
    try:
        regs.append(agent.register_memory(blocks, backends=["POSIX"]))
        regs.append(agent.register_memory(back, backends=["POSIX"]))
        regs.append(agent.register_memory([(0, size, fd, "") for fd in fds], "FILE", backends=["POSIX"]))
        files = agent.get_xfer_descs([(0, size, fd) for fd in fds], "FILE")
        src = agent.get_xfer_descs([(blocks.data_ptr() + i * size, size, 0) for i in range(n)], "DRAM")
        dst = agent.get_xfer_descs([(back.data_ptr() + i * size, size, 0) for i in range(n)], "DRAM")
        out = {}
        for op, local, name in (("WRITE", src, "write"), ("READ", dst, "read")):
            start = time.perf_counter()
            handle = agent.initialize_xfer(op, local, files, agent.name, backends=["POSIX"])
            out[f"{name}_prep_s"] = time.perf_counter() - start
            try:
                _wait(agent, handle, name)
                out[f"{name}_s"] = time.perf_counter() - start
                if op == "WRITE":
                    out["backend"] = agent.query_xfer_backend(handle)
            finally:
                agent.release_xfer_handle(handle)
        out["matched"] = torch.equal(back, blocks)
        return out
    finally:
        for reg in regs:
            try:
                agent.deregister_memory(reg, backends=["POSIX"])
            except Exception:  # cleanup only: the timings are what matters
                pass
        for fd in fds:
            os.close(fd)


def nixl_agent():
    """A NIXL agent with the POSIX backend (raises whatever NIXL raises when it cannot)."""
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("bench_disk_tier", nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("POSIX")
    return agent


# ---------------------------------------------------------------- report
def summarise(runs: list[dict], n: int) -> dict:
    mb = n * block_bytes() / 1e6
    write_s = min(r["write_s"] for r in runs)
    read_s = min(r["read_s"] for r in runs)
    row = {
        "write_mb_s": mb / write_s,
        "read_mb_s": mb / read_s,
        "ms_per_block_read": 1e3 * read_s / n,
        "matched": all(r["matched"] for r in runs),
        "write_s": [r["write_s"] for r in runs],
        "read_s": [r["read_s"] for r in runs],
    }
    for k in ("write_prep_s", "read_prep_s"):
        if k in runs[0]:
            row[k] = [r[k] for r in runs]
    return row


def table(rows: dict[str, dict]) -> str:
    lines = ["| way | write MB/s | read MB/s | ms/block read | read-back matched |", "|---|---|---|---|---|"]
    for way, r in rows.items():
        if "error" in r:
            error = " ".join(r["error"].split()).replace("|", "/")  # one table cell
            lines.append(f"| {way} | error: {error} | | | |")
        else:
            matched = "yes" if r["matched"] else "NO"
            row = f"{r['write_mb_s']:.0f} | {r['read_mb_s']:.0f} | {r['ms_per_block_read']:.3f} | {matched}"
            lines.append(f"| {way} | {row} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=256, help="KV blocks moved each way (default 256)")
    p.add_argument("--repeats", type=int, default=3, help="repeats, best reported (default 3)")
    p.add_argument("--dir", default=None, help="where the temporary folders go (default the system's temp folder)")
    args = p.parse_args(argv)
    if args.blocks < 1 or args.repeats < 1:
        p.error("--blocks and --repeats must be positive")
    base = Path(args.dir or tempfile.gettempdir())
    torch.manual_seed(0)
    blocks = torch.randn(args.blocks, *BLOCK_SHAPE, dtype=DTYPE)
    names = keys(args.blocks)

    runs: dict[str, list[dict]] = {"DiskTier (plain file I/O)": [], "NIXL POSIX": []}
    rows: dict[str, dict] = {}
    agent, nixl_error, backend_info = None, None, {}
    try:
        agent = nixl_agent()
        backend_info = {
            "plugin_params": agent.get_plugin_params("POSIX"),
            "backend_params": agent.backend_options.get("POSIX", {}),
            "mems": agent.backend_mems.get("POSIX"),
        }
    except Exception as e:  # the row records why NIXL could not run
        nixl_error = f"{type(e).__name__}: {e}"
    for _ in range(args.repeats):
        for way in runs:
            if way == "NIXL POSIX" and nixl_error:
                continue
            folder = Path(tempfile.mkdtemp(prefix="bench_disk_tier_", dir=base))
            try:
                if way == "NIXL POSIX":
                    try:
                        runs[way].append(nixl_once(agent, blocks, folder))
                    except Exception as e:  # a failed transfer: the row records it
                        nixl_error = f"{type(e).__name__}: {e}"
                else:
                    runs[way].append(disk_tier_once(blocks, names, folder))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    for way, done in runs.items():
        if way == "NIXL POSIX" and nixl_error:
            rows[way] = {"error": nixl_error}
        else:
            rows[way] = summarise(done, args.blocks)
    if "backend" in (runs["NIXL POSIX"] or [{}])[0]:
        backend_info["chosen"] = runs["NIXL POSIX"][0]["backend"]

    head = (
        f"{args.blocks} KV blocks of {block_bytes():,} bytes ({args.blocks * block_bytes() / 1e6:.0f} MB) "
        f"{'x'.join(map(str, BLOCK_SHAPE))} float32, best of {args.repeats}; "
        f"files on {fs_type(base)}, reads from the page cache; CPU: {cpu_model()}"
    )
    md = head + "\n\n" + table(rows) + "\n"
    result = {
        "blocks": args.blocks,
        "block_bytes": block_bytes(),
        "block_shape": list(BLOCK_SHAPE),
        "repeats": args.repeats,
        "dir": str(base),
        "filesystem": fs_type(base),
        "cpu": cpu_model(),
        "nixl_files": "one file per block, payload at offset 0",
        "nixl_posix": backend_info,
        "ways": rows,
    }
    out = results_dir()
    (out / "disk-tier.json").write_text(json.dumps(result, indent=2))
    (out / "disk-tier.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
