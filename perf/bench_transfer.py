"""Benchmark: KV transfer of one prompt through fabric_bridge vs raw NIXL vs memcpy.

Moves the KV of a 2048-token prompt in SmolLM2-135M's shape (30 layers, 3 KV heads,
head_dim 64, 16-token pages, fp32: 128 pages per layer, 24 KiB per page) from this process to
a receiver process, layer by layer through ``FabricAgent`` (one xfer per layer, one write per
page; NIXL merges writes adjacent on both sides into one descriptor). Page choices: destination
pages scattered over a 2x larger pool; contiguous; and the pages the engine's allocator hands out
on both sides, from fresh pools and after churn (random requests allocated and freed until the
free lists are fragmented). It compares in the same run with

* one raw NIXL write of the same bytes (one contiguous descriptor, separate plain agents),
* raw NIXL xfers of the same bytes, one per layer with a notification each (what the per-layer
  posting itself costs, whatever the descriptors),
* a local memcpy of the same bytes.

Times are to the receiver seeing completion (CLOCK_MONOTONIC is shared by processes on one
host). Prints a markdown table and writes JSON to the results folder (``perf/results/``). A short sub-run with
``UCX_PROTO_INFO=y`` reports the UCX transports/protocols chosen.

    python -m perf.bench_transfer [--reps 5] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import re
import subprocess
import sys
import threading
import time

import numpy as np
import torch

from backend.engine.page_allocator import PageAllocator
from backend.planner.stats import median
from fabric_bridge import control
from fabric_bridge.agent import FabricAgent
from fabric_bridge.layout import KVLayout
from fabric_bridge.plan import build_plan, expected_writes
from perf.lib.machine import ROOT
from perf.lib.progress import ENV as PROGRESS_ENV
from perf.lib.progress import bar
from perf.lib.results import results_dir

POLL_S = 0.0002  # raw baseline polls as often as the agent's progress thread does


def smollm2_layout(layers: int = 30) -> KVLayout:
    return KVLayout("SmolLM2-135M", layers, 16, 3, 64, "float32", 1, "HND")


def _raw_agent(name: str):
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _receiver(conn, layers: int, pages: int) -> None:
    """Receiver process: a FabricAgent with a pool twice the prompt, plus a raw NIXL agent."""
    lay = smollm2_layout(layers)
    pool = torch.zeros(layers, 2 * pages, *lay.page_shape())
    agent = FabricAgent("bench_dst", lay, [pool])
    server = control.serve(agent)
    raw = _raw_agent("bench_raw_dst")
    raw_buf = torch.zeros(layers * 2 * pages * lay.page_bytes // 4)  # room for scattered pages
    raw.register_memory(raw_buf)
    conn.send((server.port, raw.get_agent_metadata(), raw_buf.data_ptr(), raw_buf.numel() * 4))
    raw.add_remote_agent(conn.recv())
    handles, raw_done = {}, {}

    def on_done(req_id, ok, err, meta):
        handles[req_id] = (ok, err, time.monotonic())

    def poll_raw(tag: bytes):
        while True:
            for msgs in raw.get_new_notifs().values():
                if tag in msgs:
                    raw_done[tag] = time.monotonic()
                    return
            time.sleep(POLL_S)

    pollers = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "expect":
            req_id, n = args
            h = agent.expect(req_id, n, on_done=on_done, timeout_s=60, with_meta=False)
            conn.send(h.generation)
        elif cmd == "wait":
            (req_id,) = args
            while req_id not in handles:
                time.sleep(0.001)
            conn.send(handles[req_id])
        elif cmd == "raw_arm":
            (tag,) = args
            pollers[tag] = threading.Thread(target=poll_raw, args=(tag,))
            pollers[tag].start()
            conn.send(True)
        elif cmd == "raw_wait":
            (tag,) = args
            pollers.pop(tag).join()
            conn.send(raw_done[tag])
        elif cmd == "close":
            server.close()
            agent.close()
            conn.send(True)
            return


def _call(conn, *msg):
    conn.send(msg)
    return conn.recv()


def _page_rows(base: int, layers: int, pool_pages: int, page_ids, page_bytes: int) -> np.ndarray:
    """(addr, len, dev) rows of ``page_ids`` in every layer of a [layers, pool_pages] pool."""
    ids = np.asarray(page_ids, dtype=np.uint64)
    addr = base + (np.arange(layers, dtype=np.uint64)[:, None] * np.uint64(pool_pages) + ids[None, :]) * np.uint64(
        page_bytes
    )
    rows = np.zeros((addr.size, 3), dtype=np.uint64)
    rows[:, 0], rows[:, 1] = addr.ravel(), page_bytes
    return rows


def allocator_pages(pool_pages: int, pages: int, churn: bool, seed: int) -> list[int]:
    """The pages a fresh (or churned) engine allocator gives a request of ``pages`` pages."""
    alloc = PageAllocator(pool_pages, 16)
    if churn:
        rng, live = random.Random(seed), []
        for i in range(400):  # random requests come and go; about half the pool stays held
            if live and (alloc.stats()["free"] < pool_pages // 2 or rng.random() < 0.5):
                alloc.free(live.pop(rng.randrange(len(live))))
            else:
                n = rng.randint(1, max(1, pages // 8))
                if n <= alloc.stats()["free"] - pages:
                    alloc.allocate(f"c{i}", n * 16)
                    live.append(f"c{i}")
        while alloc.stats()["free"] - 1 < pages:
            alloc.free(live.pop(rng.randrange(len(live))))
    return alloc.allocate("request", pages * 16)


def runs_of(src_pages, dst_pages) -> int:
    """Descriptors per layer once writes adjacent on both sides are merged."""
    s, d = np.asarray(src_pages), np.asarray(dst_pages)
    return 1 + int(np.count_nonzero((np.diff(s) != 1) | (np.diff(d) != 1)))


def run(reps: int, tokens: int, layers: int) -> dict:
    lay = smollm2_layout(layers)
    pages = tokens // lay.page_size
    total_bytes = layers * pages * lay.page_bytes
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, layers, pages), daemon=True)
    proc.start()
    try:
        port, raw_md, raw_addr, raw_len = conn.recv()
        src_pool = torch.randn(layers, 2 * pages, *lay.page_shape())
        agent = FabricAgent("bench_src", lay, [src_pool])
        peer = control.connect(agent, "127.0.0.1", port)
        raw = _raw_agent("bench_raw_src")
        raw_src = torch.randn(total_bytes // 4)
        raw.register_memory(raw_src)
        raw_peer = raw.add_remote_agent(raw_md)
        conn.send(raw.get_agent_metadata())
        n_writes = expected_writes(lay, lay, pages)

        def page_level(req: str, dst_pages, src_pages=range(pages)) -> dict:
            gen = _call(conn, "expect", req, n_writes)
            plan = build_plan(lay, lay, src_pages, dst_pages)
            sent = threading.Event()
            before = dict(agent.stats)
            post_s = 0.0
            t0 = time.monotonic()
            for layer in range(layers):
                t = time.perf_counter()
                assert agent.post_layer(peer, req, gen, plan, layer)
                post_s += time.perf_counter() - t
            agent.finish_send(req, lambda *a: sent.set())
            ok, err, t_recv = _call(conn, "wait", req)
            assert ok and sent.wait(30), err
            in_transfer = agent.stats["transfer_call_s"] - before["transfer_call_s"]
            return {
                "make_xfer_s": agent.stats["make_xfer_s"] - before["make_xfer_s"],
                "transfer_s": t_recv - t0,
                "post_s": post_s,
                "transfer_call_s": in_transfer,
                "python_post_s": post_s - in_transfer,
                "descriptors_per_layer": runs_of(src_pages, dst_pages),
            }

        def raw_write(tag: bytes, local_rows: np.ndarray, remote_rows: np.ndarray) -> dict:
            _call(conn, "raw_arm", tag)
            local = raw.get_xfer_descs(local_rows, "DRAM")
            remote = raw.get_xfer_descs(remote_rows, "DRAM")
            t0 = time.monotonic()
            h = raw.initialize_xfer("WRITE", local, remote, raw_peer, tag)
            state = raw.transfer(h)
            while state == "PROC":
                time.sleep(POLL_S)
                state = raw.check_xfer_state(h)
            t_recv = _call(conn, "raw_wait", tag)
            assert state == "DONE", state
            h.release()
            return {"transfer_s": t_recv - t0}

        def raw_per_layer(tag: str) -> dict:
            """One raw xfer per layer (its bytes contiguous on both sides), each with its own
            notification, as the page-level path posts them: the cost of the xfers themselves."""
            layer_bytes = total_bytes // layers
            descs = [
                (
                    raw.get_xfer_descs(
                        np.array([[raw_src.data_ptr() + i * layer_bytes, layer_bytes, 0]], np.uint64), "DRAM"
                    ),
                    raw.get_xfer_descs(np.array([[raw_addr + i * layer_bytes, layer_bytes, 0]], np.uint64), "DRAM"),
                )
                for i in range(layers)
            ]
            last = f"{tag}-{layers - 1}".encode()
            _call(conn, "raw_arm", last)
            t0 = time.monotonic()
            handles = []
            for i, (local, remote) in enumerate(descs):
                h = raw.initialize_xfer("WRITE", local, remote, raw_peer, f"{tag}-{i}".encode())
                assert raw.transfer(h) != "ERR"
                handles.append(h)
            for h in handles:
                while (state := raw.check_xfer_state(h)) == "PROC":
                    time.sleep(POLL_S)
                assert state == "DONE", state
            t_recv = _call(conn, "raw_wait", last)
            for h in handles:
                h.release()
            return {"transfer_s": t_recv - t0}

        bulk_src = np.array([[raw_src.data_ptr(), total_bytes, 0]], dtype=np.uint64)
        bulk_dst = np.array([[raw_addr, total_bytes, 0]], dtype=np.uint64)
        keys = ("page_scattered", "page_contiguous", "page_fresh_alloc", "page_churned_alloc")
        runs = {k: [] for k in (*keys, "raw_pages_scattered", "raw_per_layer", "raw_bulk")}
        for rep in bar(range(reps + 1), "transfers"):  # the first repetition warms connections up, not reported
            scattered = random.Random(rep).sample(range(2 * pages), pages)
            res = {
                "page_scattered": page_level(f"s{rep}", scattered),
                "page_contiguous": page_level(f"c{rep}", range(pages)),
                "page_fresh_alloc": page_level(
                    f"f{rep}",
                    allocator_pages(2 * pages, pages, False, rep),
                    allocator_pages(2 * pages, pages, False, rep),
                ),
                "page_churned_alloc": page_level(
                    f"a{rep}",
                    allocator_pages(2 * pages, pages, True, 1000 + rep),
                    allocator_pages(2 * pages, pages, True, rep),
                ),
                "raw_pages_scattered": raw_write(
                    f"p{rep}".encode(),
                    _page_rows(raw_src.data_ptr(), layers, pages, range(pages), lay.page_bytes),
                    _page_rows(raw_addr, layers, 2 * pages, scattered, lay.page_bytes),
                ),
                "raw_per_layer": raw_per_layer(f"l{rep}"),
                "raw_bulk": raw_write(f"b{rep}".encode(), bulk_src, bulk_dst),
            }
            if rep:
                for k, v in res.items():
                    runs[k].append(v)
        _call(conn, "close")
        agent.close()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)

    a, b = torch.randn(total_bytes // 4), torch.empty(total_bytes // 4)
    b.copy_(a)
    runs["memcpy"] = []
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        runs["memcpy"].append({"transfer_s": time.perf_counter() - t})

    med = {k: {f: median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    raw_t = med["raw_bulk"]["transfer_s"]
    for m in med.values():
        m["bw_vs_raw_bulk"] = raw_t / m["transfer_s"]
        if "python_post_s" in m:
            m["python_post_fraction"] = m["python_post_s"] / m["transfer_s"]
            m["post_fraction"] = m["post_s"] / m["transfer_s"]
    return {
        "shape": {
            "model": lay.model,
            "layers": layers,
            "kv_heads": lay.num_kv_heads,
            "head_dim": lay.head_dim,
            "page_size": lay.page_size,
            "dtype": lay.dtype,
            "tokens": tokens,
            "pages_per_layer": pages,
            "page_bytes": lay.page_bytes,
        },
        "bytes": total_bytes,
        "writes": n_writes,
        "xfers": layers,
        "reps": reps,
        "median": med,
        "runs": runs,
        "ucx_tls": os.environ.get("UCX_TLS", "(unset: UCX default, all available)"),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
    }


def ucx_protocols() -> list[str]:
    """Re-run a tiny transfer with UCX_PROTO_INFO=y; return one line per distinct UCX
    protocol table: operation, then the size ranges with the protocol and transport used."""
    env = dict(os.environ, UCX_PROTO_INFO="y", **{PROGRESS_ENV: "0"})
    out = subprocess.run(
        [sys.executable, "-m", "perf.bench_transfer", "--reps", "1", "--layers", "2", "--no-probe", "--no-save"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    cells = [re.sub(r"^\[[^]]*\] \[[^]]*\]\s*", "", ln).strip() for ln in (out.stdout + out.stderr).splitlines()]
    summary, block = set(), []

    def flush():
        if len(block) > 3:  # [agent cfg], [operation], [header], rows...
            rows = "; ".join(f"{r[0]}: {r[1]} via {r[2]}" for r in block[3:] if len(r) == 3)
            summary.add(f"{block[1][0]} -> {rows}")

    for cell in cells:
        if not cell.startswith("|"):
            continue
        parts = [c.strip() for c in cell.strip("|").split("|")]
        if len(parts) == 1 and "cfg#" in parts[0]:
            flush()
            block = []
        block.append(parts)
    flush()
    return sorted(summary)


def table(r: dict) -> str:
    gb, m, w = r["bytes"] / 1e9, r["median"], r["writes"]
    rows = [
        ("fabric_bridge, layer by layer, scattered dst pages", "page_scattered", w),
        ("fabric_bridge, layer by layer, contiguous dst pages", "page_contiguous", w),
        ("fabric_bridge, layer by layer, allocator pages, fresh pools", "page_fresh_alloc", w),
        ("fabric_bridge, layer by layer, allocator pages, after churn", "page_churned_alloc", w),
        ("raw NIXL, same scattered pages, one xfer", "raw_pages_scattered", w),
        ("raw NIXL, one xfer per layer (contiguous, a notification each)", "raw_per_layer", r["xfers"]),
        ("raw NIXL, one bulk write", "raw_bulk", 1),
        ("local memcpy", "memcpy", 1),
    ]
    out = [
        "| path | bytes | writes | time (ms) | writes/s | GB/s | vs raw bulk |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, key, n in rows:
        t = m[key]["transfer_s"]
        out.append(
            f"| {name} | {r['bytes']:,} | {n:,} | {t * 1e3:.1f} | {n / t:,.0f} | {gb / t:.2f} "
            f"| {m[key]['bw_vs_raw_bulk']:.2f}x |"
        )
    out.append("")
    for key in ("page_scattered", "page_contiguous", "page_fresh_alloc", "page_churned_alloc"):
        k = m[key]
        out.append(
            f"- {key}: {k['descriptors_per_layer']:.0f} descriptors per layer after merging; "
            f"post_layer total {k['post_s'] * 1e3:.1f} ms, of which inside NIXL transfer() "
            f"{k['transfer_call_s'] * 1e3:.1f} ms (the transport copies synchronously there); "
            f"Python-side posting {k['python_post_s'] * 1e3:.2f} ms for {r['xfers']} xfers (NIXL's "
            f"make_prepped_xfer {k['make_xfer_s'] * 1e3:.2f} ms of it) = "
            f"**{k['python_post_fraction'] * 100:.1f}%** of the transfer time"
        )
    out.append(f"- median of {r['reps']} runs after one warm-up; UCX_TLS: {r['ucx_tls']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--no-probe", action="store_true", help="skip the UCX_PROTO_INFO sub-run")
    ap.add_argument("--no-save", action="store_true", help="do not write JSON")
    args = ap.parse_args(argv)
    result = run(args.reps, args.tokens, args.layers)
    if not args.no_probe:
        result["ucx_protocols"] = ucx_protocols()
    print(table(result))
    for line in result.get("ucx_protocols", []):
        print("    ", line)
    if not args.no_save:
        path = results_dir() / f"bench_transfer_{time.strftime('%Y%m%d_%H%M%S')}.json"
        path.write_text(json.dumps(result, indent=2))
        print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
