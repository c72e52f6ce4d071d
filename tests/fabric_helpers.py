"""Helpers for the fabric_bridge tests: a side (agent + synthetic KV pools) that can live in
the test process or in a spawned worker process driven over a pipe.

``Side`` holds agents by name and exposes plain methods; ``Worker`` runs a ``Side`` in a
separate process (multiprocessing spawn) and forwards method calls to it, so a test talks to
both ends of a transfer the same way. Pools cross the pipe as uint8 numpy arrays.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
import time
import traceback

import numpy as np
import torch

from fabric_bridge import control
from fabric_bridge.agent import FabricAgent
from fabric_bridge.layout import KVLayout
from fabric_bridge.plan import build_plan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_pools(layout: KVLayout, n_pages: int, seed=None) -> list[torch.Tensor]:
    """One ``[layers, pages, *page]`` tensor per shard: zeros, or random with replicas equal."""
    shape = (layout.num_layers, n_pages, *layout.page_shape())
    pools = []
    for s in range(layout.tp_size):
        if seed is None:
            pools.append(torch.zeros(shape, dtype=DTYPES[layout.dtype]))
            continue
        g = torch.Generator().manual_seed(seed * 1000 + layout.shard_heads(s).start)
        pools.append(torch.randn(shape, generator=g).to(DTYPES[layout.dtype]))
    return pools


def to_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().copy()


def from_bytes(a: np.ndarray, layout: KVLayout, n_pages: int) -> torch.Tensor:
    shape = (layout.num_layers, n_pages, *layout.page_shape())
    return torch.from_numpy(a).view(DTYPES[layout.dtype]).reshape(shape)


class Side:
    """Agents of one process, addressed by name; every method returns picklable values."""

    def __init__(self):
        self.agents: dict[str, FabricAgent] = {}
        self.servers: dict[str, control.HandshakeServer] = {}
        self.pools: dict[str, list[torch.Tensor]] = {}
        self.handles = {}
        self.released: dict[str, float] = {}
        self.sent: dict[str, tuple] = {}
        self.errors: list[tuple] = []

    def create(self, name, layout: dict, n_pages, seed=None, meta_slots=4, meta_floats=64, **kw) -> int:
        lay = KVLayout.from_dict(layout)
        self.pools[name] = make_pools(lay, n_pages, seed)
        self.agents[name] = FabricAgent(
            name,
            lay,
            self.pools[name],
            meta_slots=meta_slots,
            meta_slot_floats=meta_floats,
            on_send_error=lambda *e: self.errors.append(e),
            **kw,
        )
        self.servers[name] = control.serve(self.agents[name])
        return self.servers[name].port

    def connect(self, name, port) -> str:
        return control.connect(self.agents[name], "127.0.0.1", port)

    def read_pools(self, name) -> list[np.ndarray]:
        return [to_bytes(p) for p in self.pools[name]]

    def expect(self, name, req_id, n, **kw) -> tuple:
        h = self.agents[name].expect(
            req_id, n, on_release=lambda r, g: self.released.setdefault(r, time.monotonic()), **kw
        )
        self.handles[req_id] = h
        return h.generation, h.slot

    def wait(self, req_id, timeout=20.0) -> tuple:
        h = self.handles[req_id]
        h.done.wait(timeout)
        meta = None if h.meta is None else h.meta.numpy().copy()
        return h.done.is_set(), h.ok, h.error, meta

    def progress(self, name, req_id):
        return self.agents[name]._tracker.counts(req_id)

    def wait_released(self, req_id, timeout=20.0):
        end = time.monotonic() + timeout
        while req_id not in self.released and time.monotonic() < end:
            time.sleep(0.01)
        return self.released.get(req_id)

    def post(self, name, peer, req_id, gen, src_pages, dst_pages, layers, rng_seed=0, positions=None) -> list[bool]:
        agent = self.agents[name]
        plan = build_plan(agent.layout, agent.peer_layout(peer), src_pages, dst_pages, random.Random(rng_seed))
        return [agent.post_layer(peer, req_id, gen, plan, layer, positions) for layer in layers]

    def post_meta(self, name, peer, req_id, gen, slot, hidden, logits) -> bool:
        return self.agents[name].post_meta(peer, req_id, gen, slot, torch.tensor(hidden), torch.tensor(logits))

    def finish(self, name, req_id):
        ev = threading.Event()
        self.sent[req_id] = (ev,)

        def done(r, ok, err):
            self.sent[r] = (ev, ok, err, time.monotonic())
            ev.set()

        self.agents[name].finish_send(req_id, done)

    def wait_sent(self, req_id, timeout=20.0):
        self.sent[req_id][0].wait(timeout)
        return self.sent[req_id][1:]

    def cancel(self, name, req_id):
        self.agents[name].cancel(req_id)

    def now(self):
        return time.monotonic()

    def get_errors(self):
        return list(self.errors)

    def close(self, name=None):
        for n in [name] if name else list(self.agents):
            if n not in self.agents:
                continue
            self.servers.pop(n).close()
            self.agents.pop(n).close()
            self.pools.pop(n)


def _worker_main(conn):
    side = Side()
    while True:
        try:
            method, args, kw = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", getattr(side, method)(*args, **kw)))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class Worker:
    """A ``Side`` in a spawned process; ``worker.method(...)`` calls it there."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.proc.start()
        self.pid = self.proc.pid

    def __getattr__(self, method):
        def call(*args, **kw):
            self._conn.send((method, args, kw))
            if not self._conn.poll(60):
                raise TimeoutError(f"worker call {method} timed out")
            status, value = self._conn.recv()
            if status == "err":
                raise RuntimeError(f"worker {method} failed: {value}")
            return value

        return call

    def signal(self, sig):
        os.kill(self.pid, sig)

    def kill(self):
        if self.proc.is_alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.join(timeout=10)
