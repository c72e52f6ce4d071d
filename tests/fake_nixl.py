"""An in-process stand-in for NIXL's Python API (``nixl_cu12._api``) for unit tests.

It implements the subset of ``nixl_agent`` that ``fabric_bridge`` uses, with the same names and
arguments, and nothing else. Install it for every agent created anywhere with
``fabric_bridge.nixl_api.install(fake_nixl)`` (``tests/unit/conftest.py`` does, for each unit test).

Agents created in one process find each other through :data:`FABRIC`, the module-level
network, by name (``get_agent_metadata`` is just the name). A WRITE really copies the bytes
(``ctypes.memmove`` between registered host addresses, DRAM only) and then delivers its
notification to the target agent, like NIXL: data first, then the message. Descriptor lists are
checked against registered memory when prepared and again when an xfer lands.

Controls, on :data:`FABRIC` (``FABRIC.reset()`` between tests):

* ``auto = True``: an xfer completes inside ``transfer()``, which returns ``"DONE"`` (like UCX's
  ``cma``). ``auto = False``: it stays ``"PROC"`` in ``FABRIC.held`` until the test calls
  ``FABRIC.complete(xfers=None, shuffle=None)`` (all or the given ones, in that order or
  shuffled) or ``FABRIC.fail(xfers=None)`` (state ``"ERR"``: nothing copied, no notification).
* ``fail_posts = True``: ``transfer()`` answers ``"ERR"``.
* ``FABRIC.kill(name)``: that agent's process "dies": other agents' ``transfer``,
  ``check_xfer_state`` (of an unfinished xfer) and ``send_notif`` towards it raise
  :class:`nixlRemoteDisconnectError`; its own held xfers never land; it sends and receives nothing.
* ``notif_filter = fn(sender, target, msg) -> list[bytes]``: deliver these instead of ``[msg]``
  (``[]`` drops a notification, ``[msg, msg]`` duplicates it).
* ``abort_fails = True``: releasing an xfer still in progress raises (NIXL could not abort it).
* ``plugins`` / ``broken_backends``: the plugins an agent can load, and those whose start fails.

``FABRIC.agent(name).leaks()`` counts what an agent still holds (xfer handles and descriptor
lists not released, memory not deregistered).
"""

from __future__ import annotations

import ctypes
import enum
import random
import threading
from collections.abc import Callable, Iterable

import numpy as np

_META_PREFIX = b"fake-nixl:"


class nixlRemoteDisconnectError(RuntimeError):  # noqa: N801 - NIXL's name
    """The remote agent is gone (NIXL raises an exception of this name)."""


class nixlNotFoundError(RuntimeError):  # noqa: N801
    """Unknown agent, memory or handle."""


class nixlBackendError(RuntimeError):  # noqa: N801
    """The backend refused (e.g. could not abort an xfer in progress)."""


class nixl_thread_sync_t(enum.Enum):  # noqa: N801
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 3


class nixl_agent_config:  # noqa: N801
    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = 0,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: list[str] | None = None,
        sync_mode: nixl_thread_sync_t | None = None,
    ):
        self.enable_pthread = enable_prog_thread
        self.backends = list(backends or ["UCX"])
        self.sync_mode = sync_mode


class _Regions:
    """Memory registered with one agent: (addr, len) rows."""

    def __init__(self, rows: list[tuple[int, int]]):
        self.rows = rows


def _covered(rows: np.ndarray, regions: Iterable[_Regions]) -> bool:
    """True when every descriptor (addr, len) lies inside one registered region."""
    addr, size = rows[:, 0].astype(np.uint64), rows[:, 1].astype(np.uint64)
    ok = np.zeros(len(rows), dtype=bool)
    for reg in regions:
        for start, n in reg.rows:
            ok |= (addr >= np.uint64(start)) & (addr + size <= np.uint64(start + n))
    return bool(ok.all())


class FakeDlist:
    """A prepped descriptor list: rows (addr, len, dev) of ``owner``'s memory."""

    def __init__(self, agent: nixl_agent, owner: str, rows: np.ndarray, local: bool):
        self.agent, self.owner, self.rows, self.local = agent, owner, rows, local
        self.released = False

    def release(self) -> None:
        with FABRIC.lock:
            if not self.released:
                self.released = True
                self.agent._dlists.discard(self)


class FakeXfer:
    """A WRITE from ``agent`` to ``target``: descriptor pairs and the notification message."""

    def __init__(self, agent: nixl_agent, target: str, src: np.ndarray, dst: np.ndarray, msg: bytes):
        self.agent, self.target, self.src, self.dst, self.msg = agent, target, src, dst, msg
        self.state = "INIT"  # INIT -> PROC -> DONE | ERR
        self.released = False

    def __repr__(self) -> str:
        return f"FakeXfer({self.agent.name}->{self.target}, {self.msg!r}, {self.state})"

    def release(self) -> None:
        with FABRIC.lock:
            if self.released:
                return
            if self.state == "PROC":
                if FABRIC.abort_fails:
                    raise nixlBackendError("cannot abort an xfer in progress")
                if self in FABRIC.held:
                    FABRIC.held.remove(self)  # aborted: it never lands
                self.state = "ERR"
            self.released = True
            self.agent._xfers.discard(self)


class nixl_agent:  # noqa: N801
    """The fake of ``nixl_agent`` (see module docstring)."""

    def __init__(self, agent_name: str, nixl_conf: nixl_agent_config | None = None):
        conf = nixl_conf or nixl_agent_config()
        self.name = agent_name
        self.backends: dict[str, int] = {}
        for b in conf.backends:
            if b not in FABRIC.plugins:
                continue  # NIXL skips a backend without plugin (with a warning)
            if b in FABRIC.broken_backends:
                raise nixlBackendError(f"backend {b} failed to initialise: {FABRIC.broken_backends[b]}")
            self.backends[b] = len(self.backends)
        self._regs: list[_Regions] = []
        self._remotes: set[str] = set()
        self._notifs: dict[str, list[bytes]] = {}
        self._dlists: set[FakeDlist] = set()
        self._xfers: set[FakeXfer] = set()
        with FABRIC.lock:
            FABRIC.agents[agent_name] = self

    # -- set-up ------------------------------------------------------------------------------
    def get_plugin_list(self) -> list[str]:
        return list(FABRIC.plugins)

    def register_memory(self, reg_list, mem_type: str | None = None, backends: list[str] | None = None) -> _Regions:
        tensors = reg_list if isinstance(reg_list, list | tuple) else [reg_list]
        rows = []
        for t in tensors:
            if t.device.type != "cpu":
                raise NotImplementedError("fake NIXL moves host (DRAM) memory only")
            rows.append((t.data_ptr(), t.numel() * t.element_size()))
        reg = _Regions(rows)
        with FABRIC.lock:
            self._regs.append(reg)
        return reg

    def deregister_memory(self, dereg_list: _Regions, backends: list[str] | None = None) -> None:
        with FABRIC.lock:
            if dereg_list not in self._regs:
                raise nixlNotFoundError("memory not registered")
            self._regs.remove(dereg_list)

    def get_agent_metadata(self) -> bytes:
        return _META_PREFIX + self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> str:
        if not metadata.startswith(_META_PREFIX):
            raise nixlNotFoundError(f"not fake NIXL metadata: {metadata[:32]!r}")
        name = metadata[len(_META_PREFIX) :].decode()
        with FABRIC.lock:
            if name not in FABRIC.agents:
                raise nixlNotFoundError(f"no agent {name!r} in this process")
            self._remotes.add(name)
        return name

    def remove_remote_agent(self, agent: str) -> None:
        with FABRIC.lock:
            if agent not in self._remotes:
                raise nixlNotFoundError(f"remote agent {agent!r} not loaded")
            self._remotes.discard(agent)

    def prep_xfer_dlist(
        self, agent_name: str, xfer_list, mem_type: str | None = None, backends: list[str] | None = None
    ) -> FakeDlist:
        rows = np.asarray(xfer_list, dtype=np.uint64).reshape(-1, 3)
        with FABRIC.lock:
            local = agent_name in ("NIXL_INIT_AGENT", "")
            owner = self.name if local else agent_name
            if not local and owner != self.name and owner not in self._remotes:
                raise nixlNotFoundError(f"remote agent {owner!r} not loaded")
            regs = FABRIC.agents[owner]._regs if owner in FABRIC.agents else []
            if not _covered(rows, regs):
                raise nixlNotFoundError(f"descriptors outside memory registered by {owner}")
            dl = FakeDlist(self, owner, rows.copy(), local)
            self._dlists.add(dl)
            return dl

    # -- transfers ---------------------------------------------------------------------------
    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: FakeDlist,
        local_indices,
        remote_xfer_side: FakeDlist,
        remote_indices,
        notif_msg: bytes = b"",
        backends: list[str] | None = None,
        skip_desc_merge: bool = False,
    ) -> FakeXfer:
        if operation != "WRITE":
            raise NotImplementedError("fake NIXL only writes")
        li, ri = np.asarray(local_indices, dtype=np.int64), np.asarray(remote_indices, dtype=np.int64)
        with FABRIC.lock:
            if local_xfer_side.released or remote_xfer_side.released:
                raise nixlNotFoundError("descriptor list already released")
            if not local_xfer_side.local or remote_xfer_side.local:
                raise ValueError("need a local list and a remote list")
            if len(li) != len(ri) or len(li) == 0:
                raise ValueError(f"{len(li)} local vs {len(ri)} remote descriptors")
            for idx, dl in ((li, local_xfer_side), (ri, remote_xfer_side)):
                if idx.min() < 0 or idx.max() >= len(dl.rows):
                    raise IndexError("descriptor index out of range")
            src, dst = local_xfer_side.rows[li], remote_xfer_side.rows[ri]
            if not np.array_equal(src[:, 1], dst[:, 1]):
                raise ValueError("local and remote descriptor lengths differ")
            x = FakeXfer(self, remote_xfer_side.owner, src, dst, bytes(notif_msg))
            self._xfers.add(x)
            return x

    def transfer(self, handle: FakeXfer, notif_msg: bytes = b"") -> str:
        with FABRIC.lock:
            if handle.released or handle.state != "INIT":
                raise nixlBackendError(f"cannot post {handle}")
            if notif_msg:
                handle.msg = bytes(notif_msg)
            if handle.target in FABRIC.dead or handle.target not in FABRIC.agents:
                raise nixlRemoteDisconnectError(f"remote agent {handle.target} disconnected")
            if handle.target != self.name and handle.target not in self._remotes:
                raise nixlNotFoundError(f"remote agent {handle.target!r} not loaded")
            if FABRIC.fail_posts:
                handle.state = "ERR"
            elif FABRIC.auto and self.name not in FABRIC.dead:
                FABRIC._land(handle)
            else:
                handle.state = "PROC"
                if self.name not in FABRIC.dead:  # a dead process's writes never land
                    FABRIC.held.append(handle)
            return handle.state

    def check_xfer_state(self, handle: FakeXfer) -> str:
        with FABRIC.lock:
            if handle.released:
                raise nixlNotFoundError(f"{handle} already released")
            if handle.state == "PROC" and handle.target in FABRIC.dead:
                raise nixlRemoteDisconnectError(f"remote agent {handle.target} disconnected")
            return handle.state

    # -- notifications -----------------------------------------------------------------------
    def get_new_notifs(self, backends: list[str] | None = None) -> dict[str, list[bytes]]:
        with FABRIC.lock:
            out, self._notifs = self._notifs, {}
            return {} if self.name in FABRIC.dead else out

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: str | None = None) -> None:
        with FABRIC.lock:
            if self.name in FABRIC.dead:
                return
            if remote_agent_name in FABRIC.dead:
                raise nixlRemoteDisconnectError(f"remote agent {remote_agent_name} disconnected")
            if remote_agent_name not in self._remotes:
                raise nixlNotFoundError(f"remote agent {remote_agent_name!r} not loaded")
            FABRIC._deliver(self.name, remote_agent_name, bytes(notif_msg))

    # -- for tests ---------------------------------------------------------------------------
    def leaks(self) -> dict[str, int]:
        """What this agent still holds (all 0 after a clean close)."""
        with FABRIC.lock:
            return {"xfers": len(self._xfers), "dlists": len(self._dlists), "registrations": len(self._regs)}


class Fabric:
    """The in-process network: agents by name, xfers held for the test, fault switches."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.agents: dict[str, nixl_agent] = {}
            self.held: list[FakeXfer] = []
            self.dead: set[str] = set()
            self.auto = True
            self.fail_posts = False
            self.abort_fails = False
            self.notif_filter: Callable[[str, str, bytes], list[bytes]] | None = None
            self.plugins = ["UCX", "LIBFABRIC", "POSIX"]
            self.broken_backends = {"LIBFABRIC": "no EFA device"}

    def agent(self, name: str) -> nixl_agent:
        with self.lock:
            return self.agents[name]

    def complete(self, xfers: Iterable[FakeXfer] | None = None, shuffle: random.Random | None = None) -> int:
        """Land held xfers (default all) in the given order, or shuffled; returns how many."""
        with self.lock:
            todo = [x for x in (list(self.held) if xfers is None else xfers) if x in self.held]
            if shuffle is not None:
                shuffle.shuffle(todo)
            for x in todo:
                self.held.remove(x)
                self._land(x)
            return len(todo)

    def fail(self, xfers: Iterable[FakeXfer] | None = None) -> int:
        """Put held xfers (default all) in ERR: nothing copied, no notification."""
        with self.lock:
            todo = [x for x in (list(self.held) if xfers is None else xfers) if x in self.held]
            for x in todo:
                self.held.remove(x)
                x.state = "ERR"
            return len(todo)

    def kill(self, name: str) -> None:
        """The agent's process dies (see module docstring)."""
        with self.lock:
            self.dead.add(name)
            self.held = [x for x in self.held if x.agent.name != name]

    # -- internals (lock held) ---------------------------------------------------------------
    def _land(self, x: FakeXfer) -> None:
        target = self.agents.get(x.target)
        if (
            target is None
            or x.target in self.dead
            or not _covered(x.src, x.agent._regs)
            or not _covered(x.dst, target._regs)
        ):
            x.state = "ERR"  # memory gone (deregistered) or peer gone: nothing is written
            return
        for (s, n, _), (d, _, _) in zip(x.src.tolist(), x.dst.tolist()):
            ctypes.memmove(d, s, n)
        x.state = "DONE"
        if x.msg:
            self._deliver(x.agent.name, x.target, x.msg)

    def _deliver(self, sender: str, target: str, msg: bytes) -> None:
        agent = self.agents.get(target)
        if agent is None or target in self.dead:
            return
        msgs = [msg] if self.notif_filter is None else self.notif_filter(sender, target, msg)
        agent._notifs.setdefault(sender, []).extend(msgs)


FABRIC = Fabric()
