"""Keeps the ``tritonserver`` of ``triton-disagg serve`` running: when the process exits without
having been asked to stop (``kill -9``, an abort of Triton's Python backend), it is started
again with the same deployment (``TritonServer.restart``: same repository, ports, settings and
secret; its instances join the membership as at any start), at most ``max_restarts`` times
within a sliding window of ``window_s`` seconds."""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("triton_disagg.server")


@dataclass(frozen=True)
class RestartPolicy:
    """``max_restarts`` (``serve --max-restarts``): restarts allowed within any ``window_s``
    seconds; one more exit stops the deployment. 0: never restarted."""

    max_restarts: int = 5
    window_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0 (0: never restart), got {self.max_restarts}")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")


def how_it_ended(returncode: int | None) -> str:
    """``-9`` -> ``killed by signal 9 (SIGKILL)``; None: the process of a failed restart."""
    if returncode is None:
        return "its restart failed"
    if returncode < 0:
        try:
            return f"killed by signal {-returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class ServerWatch:
    """Watches ``server`` (a started ``TritonServer``: its ``proc`` and ``restart()``) and restarts
    it by ``policy``; ``restarts`` counts them all, ``clock`` is injectable for tests."""

    def __init__(self, server, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic):
        self.server, self.policy, self.clock = server, policy, clock
        self.restarts = 0
        self._recent: deque[float] = deque()  # when the restarts within the window happened

    def run(self, stop_requested: Callable[[], bool], period_s: float = 0.5) -> str:
        """Watch until ``stop_requested()`` (then ""), or until the server exits once more than
        the policy allows: then the reason it stays down, naming the setting."""
        while not stop_requested():
            proc = self.server.proc
            if proc is not None and proc.poll() is None:
                time.sleep(period_s)
            elif not stop_requested():  # an exit that a stop asked for is no failure
                refusal = self.on_exit(None if proc is None else proc.returncode)
                if refusal:
                    return refusal
        return ""

    def on_exit(self, returncode: int | None) -> str:
        """Restart the server that exited (logged in one line), or say why not."""
        ended, now = how_it_ended(returncode), self.clock()
        while self._recent and now - self._recent[0] >= self.policy.window_s:
            self._recent.popleft()
        limit = f"--max-restarts {self.policy.max_restarts}"
        if self.policy.max_restarts == 0:
            return f"tritonserver exited unexpectedly ({ended}); {limit}: not restarted"
        if len(self._recent) >= self.policy.max_restarts:
            return (
                f"tritonserver exited unexpectedly ({ended}) after {len(self._recent)} restarts within "
                f"{self.policy.window_s:g} s, as many as {limit} allows"
            )
        self._recent.append(now)
        self.restarts += 1
        log.error(
            "tritonserver exited unexpectedly (%s); restart %d (%d of %s within %g s)",
            ended,
            self.restarts,
            len(self._recent),
            limit,
            self.policy.window_s,
        )
        try:
            self.server.restart()
        except Exception as e:  # counted: the next pass sees no process
            log.error("tritonserver restart %d failed: %s", self.restarts, e)
        else:
            log.warning("tritonserver restarted (restart %d): serving again on the same ports", self.restarts)
        return ""
