"""A helper service this project starts as a plain process of its own (etcd, the shared KV tier's
Redis): its process group, its log in a file, a start that waits until it answers, kill (as a
crash would) and stop (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


class ServiceProcess:
    name = "service"

    def __init__(self, log_file: Path) -> None:
        self.log_file = Path(log_file)
        self.proc: subprocess.Popen | None = None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _launch(self, command: list[str], answers: Callable[[], bool], where: str, timeout_s: float) -> None:
        """Start ``command`` and wait until ``answers()``; raise with the tail of its log if it
        exits or does not answer within ``timeout_s``."""
        if self.running():
            raise RuntimeError(f"{self.name} at {where} is already running")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise RuntimeError(f"{self.name} exited with code {code} while starting; its log:\n{self._log_tail()}")
            if answers():
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"{self.name} at {where} not serving after {timeout_s} s; its log:\n{self._log_tail()}"
                )
            time.sleep(0.1)

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _signal(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is None:
            return
        self._signal(signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        if self.proc is not None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
            self.proc = None
