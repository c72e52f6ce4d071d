"""Benchmark: the shared KV tier's store over TCP on this machine, Redis vs Mooncake Store.

A block is one 16-token page of SmolLM2-135M's KV for all 30 layers (float32, 737,280 bytes);
``--blocks`` distinct random blocks are put, read back and looked up in each store, side by side in
one run. Each store is started here as child processes on free local ports and stopped at the end:

* Redis: ``redis-server --save '' --appendonly no --maxmemory 2gb --maxmemory-policy allkeys-lru``,
  reached with the ``redis`` client the way ``backend/cluster/kv_store.py`` does (``SET``/``GET``;
  existence = one pipeline of ``EXISTS``).
* Mooncake Store (``mooncake-transfer-engine-non-cuda``): ``mooncake_master`` (with its embedded
  HTTP metadata server, so no etcd) plus one ``mooncake_client`` process that holds the memory
  (``--global_segment_size``, 2 GB by default, like Redis' bound). The benchmark's own client
  contributes no memory (global segment 0, a local transfer buffer only), so every block crosses
  the TCP transport to the holder, as it would for an engine on another host. Two rows: the bytes
  API (``put``/``get``) and the zero-copy API (``put_from``/``get_into`` from/into buffers
  registered once, outside the timings). Existence = ``batch_is_exist``.

Per store: put and get latency per block (median and p90 over all repeats' blocks, ms), MB/s
(payload bytes, 1e6, over the summed per-block times), an existence check of ``--exists-batch``
names (half present, half absent) in one call (median ms), the resident memory (``VmRSS``) of the
store's processes before and after the first repeat's puts (``N`` blocks held), and the time from
starting the store's processes to the first successful put+get of a probe key. Every get's bytes
are compared with the block put (outside the timing). Each repeat uses fresh keys. If Mooncake
cannot be imported, cannot start or a call fails, its row records the error and the Redis row is
still reported.

Mooncake is optional: its wheel is not in the project's environment. Its binaries need
``libibverbs.so.1`` (and libnl) even for TCP; where those are not installed, unpack the Debian
packages somewhere and pass that folder with ``--lib-dir`` (preloaded here and added to the
children's ``LD_LIBRARY_PATH``). Run from the repository root, e.g.:

    python3 -m venv /tmp/mc-venv && /tmp/mc-venv/bin/pip install mooncake-transfer-engine-non-cuda redis
    /tmp/mc-venv/bin/python -m perf.bench_kv_store [--blocks 128] [--repeats 3] [--lib-dir DIR ...]

Imports nothing from the project (no torch).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BLOCK_BYTES = 30 * 2 * 3 * 16 * 64 * 4  # layers, K/V, KV heads, 16-token page, head_dim, float32: 737,280
START_TIMEOUT_S = 60.0
EXISTS_CALLS = 20


@dataclass
class Result:
    name: str
    put_ms: list[float] = field(default_factory=list)
    get_ms: list[float] = field(default_factory=list)
    exists_ms: list[float] = field(default_factory=list)
    rss_idle_mb: float | None = None
    rss_after_mb: float | None = None
    start_s: float | None = None
    error: str | None = None
    note: str = ""


# --- helpers --------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, deadline: float, proc: subprocess.Popen) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{Path(str(proc.args[0])).name} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"port {port} not open after {START_TIMEOUT_S:.0f} s")


def rss_mb(pids: list[int]) -> float:
    total_kb = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total_kb += int(line.split()[1])
    return total_kb / 1024


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def mbps(ms: list[float], nbytes: int) -> float:
    return len(ms) * nbytes / 1e6 / (sum(ms) / 1e3) if ms else float("nan")


def log_tail(path: Path, n: int = 3) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(ln[-200:] for ln in lines[-n:])


def stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in reversed(procs):
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def cpu_model() -> str:
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model {info.get('model', '?')})"


def preload_libs(dirs: list[str]) -> None:
    """dlopen every shared library in ``dirs`` (RTLD_GLOBAL), retrying until dependencies resolve."""
    pending = [str(p) for d in dirs for p in sorted(Path(d).rglob("*.so*")) if p.is_file() or p.is_symlink()]
    while pending:
        failed = []
        for path in pending:
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                failed.append(path)
        if len(failed) == len(pending):
            return
        pending = failed


def lib_dirs(dirs: list[str]) -> list[str]:
    """The given folders plus their ``lib/x86_64-linux-gnu``-style subfolders holding ``.so`` files."""
    out: list[str] = []
    for d in dirs:
        for p in [Path(d), *Path(d).rglob("*")]:
            if p.is_dir() and any(f.name.endswith(".so") or ".so." in f.name for f in p.iterdir()):
                out.append(str(p))
    return out


# --- the measurement, common to both stores ----------------------------------------------------------------------


@dataclass
class Ops:
    put: Callable[[int, str], None]  # (block index, key)
    get: Callable[[int, str], bytes | memoryview | None]  # (block index, key) -> what was read
    exists: Callable[[list[str]], list[bool]]


def measure(res: Result, ops: Ops, blocks: list[bytes], repeats: int, batch: int, pids: list[int], tag: str) -> None:
    """Fills ``res``; each get's bytes are compared with the block put (outside the timing)."""
    n = len(blocks)
    for r in range(repeats):
        names = [f"bench:{tag}:{r}:{i}" for i in range(n)]
        if r == 0:
            res.rss_idle_mb = rss_mb(pids)
        for i, key in enumerate(names):
            t = time.perf_counter()
            ops.put(i, key)
            res.put_ms.append((time.perf_counter() - t) * 1e3)
        if r == 0:
            res.rss_after_mb = rss_mb(pids)
        for i, key in enumerate(names):
            t = time.perf_counter()
            got = ops.get(i, key)
            res.get_ms.append((time.perf_counter() - t) * 1e3)
            if got is None or bytes(got) != blocks[i]:
                raise RuntimeError(f"get {key}: bytes differ or missing")
        half = min(batch // 2, n)
        query = names[:half] + [f"bench:{tag}:absent:{r}:{i}" for i in range(batch - half)]
        want = [True] * half + [False] * (batch - half)
        for _ in range(EXISTS_CALLS):
            t = time.perf_counter()
            got = ops.exists(query)
            res.exists_ms.append((time.perf_counter() - t) * 1e3)
            if got != want:
                raise RuntimeError(f"exists returned {got} for {want}")


# --- Redis ------------------------------------------------------------------------------------------------------


def run_redis(args, blocks: list[bytes], work: Path) -> Result:
    res = Result("Redis 7 (SET/GET, pipelined EXISTS)")
    try:
        import redis
    except ImportError as e:
        res.error = f"redis client not importable: {e}"
        return res
    exe = shutil.which(args.redis_server) or args.redis_server
    port = free_port()
    log = work / "redis.log"
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--maxmemory", "2gb"]
    cmd += ["--maxmemory-policy", "allkeys-lru", "--protected-mode", "no", "--dir", str(work)]
    procs: list[subprocess.Popen] = []
    try:
        t0 = time.monotonic()
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, socket_connect_timeout=0.5)
        deadline = t0 + START_TIMEOUT_S
        while True:
            try:
                client.set("probe", b"x")
                if client.get("probe") == b"x":
                    break
            except redis.exceptions.ConnectionError:
                if procs[0].poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        res.start_s = time.monotonic() - t0
        res.note = "1 process"

        def put(i: int, key: str) -> None:
            client.set(key, blocks[i])

        def get(i: int, key: str) -> bytes | None:
            return client.get(key)

        def exists(names: list[str]) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return [bool(x) for x in pipe.execute()]

        measure(res, Ops(put, get, exists), blocks, args.repeats, args.exists_batch, [procs[0].pid], "r")
    except Exception as e:  # the row records it
        res.error = f"{type(e).__name__}: {e} {log_tail(log)}".strip()
    finally:
        stop(procs)
    return res


# --- Mooncake -------------------------------------------------------------------------------------------------------


def run_mooncake(args, blocks: list[bytes], work: Path) -> list[Result]:
    plain = Result("Mooncake Store (put/get)")
    zcopy = Result("Mooncake Store (put_from/get_into)")
    rows = [plain, zcopy]
    dirs = lib_dirs(args.lib_dir)
    try:
        preload_libs(dirs)
        import mooncake
        from mooncake.store import MooncakeDistributedStore
    except Exception as e:  # ImportError, or OSError from a missing libibverbs
        for r in rows:
            r.error = f"mooncake not importable: {type(e).__name__}: {e}"
        return rows
    pkg = Path(mooncake.__file__).parent
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*dirs, env.get("LD_LIBRARY_PATH", "")]).strip(os.pathsep)
    rpc, meta, metrics, holder_port = free_port(), free_port(), free_port(), free_port()
    meta_url = f"http://127.0.0.1:{meta}/metadata"
    master_cmd = [str(pkg / "mooncake_master"), f"--rpc_port={rpc}", "--enable_http_metadata_server=true"]
    master_cmd += ["--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={meta}"]
    master_cmd += [f"--metrics_port={metrics}", "--logtostderr"]
    holder_cmd = [str(pkg / "mooncake_client"), "--host=127.0.0.1", f"--port={holder_port}"]
    holder_cmd += [f"--global_segment_size={args.segment_gb} GB", f"--master_server_address=127.0.0.1:{rpc}"]
    holder_cmd += [f"--metadata_server={meta_url}", "--protocol=tcp", "--logtostderr"]
    logs = [work / "mooncake_master.log", work / "mooncake_client.log"]
    procs: list[subprocess.Popen] = []
    store = None
    bufs: list = []
    try:
        t0 = time.monotonic()
        deadline = t0 + START_TIMEOUT_S
        with open(logs[0], "wb") as f:
            procs.append(subprocess.Popen(master_cmd, stdout=f, stderr=subprocess.STDOUT, env=env))
        wait_port(rpc, deadline, procs[0])
        wait_port(meta, deadline, procs[0])
        with open(logs[1], "wb") as f:
            procs.append(subprocess.Popen(holder_cmd, stdout=f, stderr=subprocess.STDOUT, env=env))
        wait_port(holder_port, deadline, procs[1])
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", meta_url, 0, args.local_buffer_mb << 20, "tcp", "", f"127.0.0.1:{rpc}")
        if rc != 0:
            raise RuntimeError(f"setup returned {rc}")
        while True:
            rc = store.put("probe", b"x")
            if rc == 0 and store.get("probe") == b"x":
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"probe put returned {rc}")
            time.sleep(0.02)
        start_s = time.monotonic() - t0
        pids = [p.pid for p in procs]
        for r in rows:
            r.start_s = start_s
            r.note = f"2 processes (master + segment holder, {args.segment_gb} GB)"

        def exists(names: list[str]) -> list[bool]:
            got = store.batch_is_exist(names)
            if any(x < 0 for x in got):
                raise RuntimeError(f"batch_is_exist returned {got}")
            return [x == 1 for x in got]

        def put(i: int, key: str) -> None:
            rc = store.put(key, blocks[i])
            if rc != 0:
                raise RuntimeError(f"put {key} returned {rc}")

        def get(i: int, key: str) -> bytes:
            return store.get(key)  # b"" when missing

        try:
            measure(plain, Ops(put, get, exists), blocks, args.repeats, args.exists_batch, pids, "p")
        except Exception as e:
            plain.error = f"{type(e).__name__}: {e} {log_tail(logs[1])}".strip()

        # Zero-copy: the blocks in one registered buffer (as an engine's host KV pool), reads into another.
        n, size = args.blocks, args.block_bytes
        src = ctypes.create_string_buffer(n * size)
        dst = ctypes.create_string_buffer(n * size)
        bufs += [src, dst]
        for i, b in enumerate(blocks):
            ctypes.memmove(ctypes.addressof(src) + i * size, b, size)
        for buf in (src, dst):
            rc = store.register_buffer(ctypes.addressof(buf), n * size)
            if rc != 0:
                raise RuntimeError(f"register_buffer returned {rc}")
        view = memoryview(dst).cast("B")

        def put_from(i: int, key: str) -> None:
            rc = store.put_from(key, ctypes.addressof(src) + i * size, size)
            if rc != 0:
                raise RuntimeError(f"put_from {key} returned {rc}")

        def get_into(i: int, key: str) -> memoryview:
            got = store.get_into(key, ctypes.addressof(dst) + i * size, size)
            if got != size:
                raise RuntimeError(f"get_into {key} returned {got}")
            return view[i * size : (i + 1) * size]

        try:
            measure(zcopy, Ops(put_from, get_into, exists), blocks, args.repeats, args.exists_batch, pids, "z")
        except Exception as e:
            zcopy.error = f"{type(e).__name__}: {e} {log_tail(logs[1])}".strip()
        view.release()
        for buf in (src, dst):
            store.unregister_buffer(ctypes.addressof(buf))
    except Exception as e:  # the rows record it
        msg = f"{type(e).__name__}: {e} {log_tail(logs[0])} {log_tail(logs[1])}".strip()
        for r in rows:
            r.error = r.error or msg
    finally:
        if store is not None:
            store.close()
        stop(procs)
    return rows


# --- report ---------------------------------------------------------------------------------------------------------


def table(rows: list[Result], nbytes: int) -> str:
    head = [
        "store",
        "put ms p50",
        "put ms p90",
        "get ms p50",
        "get ms p90",
        "put MB/s",
        "get MB/s",
        "exists ms p50",
        "RSS MB idle -> after N puts",
        "start s",
        "processes / error",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        error = r.error if r.error is None or len(r.error) <= 400 else r.error[:400] + "..."
        if error and not r.put_ms:
            cells = [r.name] + ["-"] * (len(head) - 3)
            cells += [f"{r.start_s:.2f}" if r.start_s is not None else "-", f"ERROR: {error}"]
        else:
            rss = f"{r.rss_idle_mb:.0f} -> {r.rss_after_mb:.0f}" if r.rss_after_mb is not None else "-"
            cells = [
                r.name,
                f"{pct(r.put_ms, 0.5):.2f}",
                f"{pct(r.put_ms, 0.9):.2f}",
                f"{pct(r.get_ms, 0.5):.2f}",
                f"{pct(r.get_ms, 0.9):.2f}",
                f"{mbps(r.put_ms, nbytes):.0f}",
                f"{mbps(r.get_ms, nbytes):.0f}",
                f"{pct(r.exists_ms, 0.5):.3f}",
                rss,
                f"{r.start_s:.2f}",
                r.note + (f"; ERROR: {error}" if error else ""),
            ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=128, help="distinct random blocks per repeat (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="repeats, each with fresh keys (default 3)")
    p.add_argument("--block-bytes", type=int, default=BLOCK_BYTES, help=f"block size (default {BLOCK_BYTES})")
    p.add_argument("--exists-batch", type=int, default=32, help="names per existence check (default 32)")
    p.add_argument("--stores", default="redis,mooncake", help="comma-separated: redis, mooncake (default both)")
    p.add_argument("--redis-server", default="redis-server", help="redis-server executable")
    p.add_argument("--segment-gb", type=int, default=2, help="Mooncake segment holder's memory, GB (default 2)")
    p.add_argument("--local-buffer-mb", type=int, default=64, help="Mooncake client's transfer buffer, MB")
    p.add_argument(
        "--lib-dir",
        action="append",
        default=[d for d in os.environ.get("MOONCAKE_LIB_DIR", "").split(os.pathsep) if d],
        help="folder with libibverbs.so.1/libnl (searched recursively) for Mooncake; repeatable "
        "(default $MOONCAKE_LIB_DIR)",
    )
    args = p.parse_args(argv)
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    blocks = [os.urandom(args.block_bytes) for _ in range(args.blocks)]
    rows: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-kv-store-") as tmp:
        work = Path(tmp)
        if "redis" in stores:
            rows.append(run_redis(args, blocks, work))
        if "mooncake" in stores:
            # The in-process Mooncake client logs (glog) to fd 2: into a file for the run, not the terminal.
            saved = os.dup(2)
            try:
                with open(work / "mooncake_bench_client.log", "wb") as f:
                    os.dup2(f.fileno(), 2)
                    rows.extend(run_mooncake(args, blocks, work))
            finally:
                os.dup2(saved, 2)
                os.close(saved)
    print(
        f"KV store over TCP (127.0.0.1): {args.blocks} blocks x {args.block_bytes:,} bytes, {args.repeats} repeats, "
        f"exists of {args.exists_batch} names x {EXISTS_CALLS} calls a repeat; {cpu_model()}, {os.cpu_count()} CPUs"
    )
    print()
    print(table(rows, args.block_bytes))
    # A store that is not installed here is reported, not a failure; one that started and failed is.
    return 0 if all(r.error is None or r.error.startswith("mooncake not importable") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
