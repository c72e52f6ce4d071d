"""Brings dead model instances back: watches a server's Python-backend stub processes and,
when one dies, reloads its model through Triton's model-control API (unload, then load). A model
whose instance is out of service for good (a tensor-parallel instance that lost a rank) asks for
the same by a file in the repository (``backend/triton/lifecycle.request_reload``).

Triton does not restart a dead stub by itself: every later request to the model fails with
"stub process is not healthy" while the model still reads as ready. While a reload runs,
Triton's readiness (``/v2/health/ready``, strict) answers "not ready"; the front model routes
around a decode model that fails its probes (``backend/triton/front_model.py``); decode
instances reconnect to a prefill instance that comes back (``backend/disagg/messenger.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import requests

from backend.triton.lifecycle import RELOAD_PREFIX

log = logging.getLogger("triton_disagg.supervisor")
LOG_LINES = 40  # of the server's log, logged with a death: a stub's fatal error is printed there


def model_of(instance: str) -> str:
    """``decode_0_0_0`` -> ``decode_0`` (Triton names instances ``<model>_<group>_<index>``)."""
    return instance.rsplit("_", 2)[0]


@dataclass
class Restart:
    model: str
    instances: list[str]
    t_detected: float
    t_ready: float | None = None
    error: str | None = None
    reason: str = "died"  # or why the model asked to be loaded again


class Supervisor:
    """``server``: a started :class:`~backend.launch.server.TritonServer` (its HTTP endpoint
    and stub processes). ``restarts`` records every reload, for logs and tests."""

    def __init__(self, server, period_s: float = 0.5, load_timeout_s: float = 300.0):
        self.server = server
        self.period_s, self.load_timeout_s = period_s, load_timeout_s
        self.restarts: list[Restart] = []
        self._expected: dict[str, int] = {}
        self._busy: set[str] = set()  # models being reloaded
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> "Supervisor":
        self._expected = self.server.instance_pids()
        log.info("supervising %d model instance(s): %s", len(self._expected), sorted(self._expected))
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._check()
            except Exception:
                log.exception("supervisor check failed")

    def _check(self) -> None:
        if self.server.proc is None or self.server.proc.poll() is not None:
            return  # the server itself is gone: its stubs with it (``serve`` restarts the server)
        live = self.server.instance_pids()
        dead: dict[str, list[str]] = {}
        with self._lock:
            for instance, pid in self._expected.items():
                model = model_of(instance)
                if live.get(instance) == pid or model in self._busy:
                    continue
                # a scan of /proc can miss a process that runs: only the pid's own end counts
                if self.server.stub_alive(pid):
                    log.debug("instance %s (pid %d) missing from a scan but alive", instance, pid)
                    continue
                dead.setdefault(model, []).append(instance)
            self._busy.update(dead)
        for model, reason in self._reload_requests():
            instances = [i for i in self._expected if model_of(i) == model]
            restart = Restart(model, instances, time.monotonic(), reason=reason)
            self.restarts.append(restart)
            log.error("model %s asked to be loaded again (%s); reloading it", model, reason)
            threading.Thread(target=self._reload, args=(restart,), name=f"reload-{model}", daemon=True).start()
        for model, instances in dead.items():
            restart = Restart(model, instances, time.monotonic())
            self.restarts.append(restart)
            log.error(
                "model %s: instance(s) %s died; reloading the model%s",
                model,
                ", ".join(instances),
                self.server.log_tail(LOG_LINES),
            )
            threading.Thread(target=self._reload, args=(restart,), name=f"reload-{model}", daemon=True).start()

    def _reload_requests(self) -> list[tuple[str, str]]:
        """The models that asked to be loaded again, with each one's reason (their request files,
        removed as read; a request of a model being reloaded now is the old instance's, which
        that reload answers)."""
        asked = []
        for path in self.server.repo.glob(f"{RELOAD_PREFIX}*"):
            model = path.name[len(RELOAD_PREFIX) :]
            try:
                reason = path.read_text(errors="replace").strip()
                path.unlink()
            except OSError:
                reason = "its request file could not be read"
            with self._lock:
                if model in self._busy:
                    continue
                self._busy.add(model)
            asked.append((model, reason))
        return asked

    def _reload(self, restart: Restart) -> None:
        base = f"http://{self.server.http_url}/v2/repository/models/{restart.model}"
        try:
            r = requests.post(f"{base}/unload", timeout=30)
            if r.status_code != 200:
                raise RuntimeError(f"unload answered {r.status_code}: {r.text}")
            r = requests.post(f"{base}/load", timeout=self.load_timeout_s)
            if r.status_code != 200:
                raise RuntimeError(f"load answered {r.status_code}: {r.text}")
            restart.t_ready = time.monotonic()
            log.warning(
                "model %s reloaded in %.1fs; its instances serve again",
                restart.model,
                restart.t_ready - restart.t_detected,
            )
        except Exception as e:
            restart.error = f"{type(e).__name__}: {e}"
            log.error("model %s: reload failed (%s); will retry", restart.model, restart.error)
            self._stop.wait(5.0)  # back off before the next try
        finally:
            live = self.server.instance_pids()
            with self._lock:
                for instance in [i for i in self._expected if model_of(i) == restart.model]:
                    if instance in live:
                        self._expected[instance] = live[instance]
                self._busy.discard(restart.model)
