"""The worker rank processes of a tensor-parallel instance, seen from the lead: started with
``python -m backend.parallel.rank``, fed step messages through their stdin, watched, stopped."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from backend.parallel.comm import write_step_message

REPO_ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("triton_disagg.engine")


def _python() -> str:
    """The interpreter to start ranks with (inside Triton's stub, sys.executable is the stub)."""
    if os.path.basename(sys.executable or "").startswith("python"):
        return sys.executable
    return os.path.join(sys.prefix, "bin", "python")


class RankProcesses:
    """Lead side: ranks 1..world-1 as child processes fed through their stdin."""

    def __init__(self, config: dict, world: int, port: int, prefix: str, handles: list[tuple]):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        self.procs: list[subprocess.Popen] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        for rank in range(1, world):
            p = subprocess.Popen(
                [_python(), "-m", "backend.parallel.rank"],
                stdin=subprocess.PIPE,
                cwd=str(REPO_ROOT),
                env=env,
                start_new_session=True,
            )  # no terminal signals
            self.procs.append(p)
            write_step_message(
                p.stdin,
                {
                    "config": config,
                    "rank": rank,
                    "world": world,
                    "port": port,
                    "prefix": prefix,
                    "shard": handles[rank],
                },
            )

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, msg) -> None:
        with self._lock:
            for p in self.procs:
                write_step_message(p.stdin, msg)

    def exit_reason(self, wait_s: float = 0.0) -> str | None:
        """Which rank exited and how, waiting up to ``wait_s`` for one to; None if all run."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, p in enumerate(self.procs, start=1):
                code = p.poll()
                if code is not None:
                    how = f"signal {-code}" if code < 0 else f"exit code {code}"
                    return f"rank {rank} (pid {p.pid}) exited ({how})"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def watch(self, on_exit: Callable[[str], None]) -> None:
        """Call ``on_exit(reason)`` once if a rank exits before :meth:`stop`."""

        def run():
            while not self._stopping.wait(0.2):
                reason = self.exit_reason()
                if reason and not self._stopping.is_set():
                    on_exit(reason)
                    return

        threading.Thread(target=run, name="tp-rank-watch", daemon=True).start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask every rank to stop; kill those still running after ``timeout_s``."""
        self._stopping.set()
        for p in self.procs:
            assert p.stdin is not None  # started with stdin=PIPE
            try:
                with self._lock:
                    write_step_message(p.stdin, ("stop",))
                p.stdin.close()
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
