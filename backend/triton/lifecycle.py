"""The stop signal of a deployment, as the models see it.

Triton stops a server only once every model has unloaded, and a decoupled model with streams
still open does not unload: on a stop with requests in flight Triton's exit timeout expires and
it exits hard. So whoever stops a server (``backend/launch/server.py``) first creates the file
:data:`DRAIN_FILE` in the model repository; each model watches for it (:class:`DrainWatch`),
refuses new requests and ends the ones in flight with a clear error, and Triton then unloads
every model within its exit timeout. Only a process that may write the repository can do this.
The drain is graceful (requests in flight may finish); when its time is up, the stopper creates
:data:`DRAIN_NOW_FILE` too, and the models end what is still in flight at once, with the drain
message, before Triton closes its endpoints.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("triton_disagg.lifecycle")

DRAIN_FILE = ".drain"
DRAIN_NOW_FILE = ".drain-now"
DRAIN_MESSAGE = "the server is shutting down"


def drain_file(repository: str | Path) -> Path:
    return Path(repository) / DRAIN_FILE


def drain_now_file(repository: str | Path) -> Path:
    return Path(repository) / DRAIN_NOW_FILE


RELOAD_PREFIX = ".reload-"  # + the model's name: the model asks its server's supervisor to load it again


def reload_request_file(repository: str | Path, model: str) -> Path:
    return Path(repository) / f"{RELOAD_PREFIX}{model}"


def request_reload(model_dir: str, model: str, reason: str) -> None:
    """Ask the supervisor of this model's server (``backend/launch/supervisor.py``) to load the
    model again (unload, then load: its instances start afresh), for ``reason``: what a
    tensor-parallel instance that lost a rank does. A server started without the supervisor
    leaves the request unanswered and the instance out of service."""
    path = reload_request_file(Path(model_dir).parent, model)
    try:
        path.write_text(reason)
    except OSError as e:
        log.error("model %s: cannot ask to be loaded again (%s): it stays out of service", model, e)
        return
    log.error("model %s: %s; asked the server's supervisor to load it again", model, reason)


class DrainWatch:
    """Calls ``on_drain`` once, from its own thread, when the drain file appears in the
    repository that holds ``model_dir`` (``args["model_repository"]`` of a Python model), then
    ``on_drain_now`` once when the drain-now file does."""

    def __init__(
        self,
        model_dir: str,
        on_drain: Callable[[], object],
        period_s: float = 0.2,
        on_drain_now: Callable[[], object] | None = None,
    ):
        self.path = drain_file(Path(model_dir).parent)
        self.now_path = drain_now_file(Path(model_dir).parent)
        self._on_drain, self._on_drain_now = on_drain, on_drain_now
        self._period = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drain-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            if self.path.exists():
                log.info("%s appeared: draining", self.path)
                try:
                    self._on_drain()
                except Exception:
                    log.exception("draining failed")
                self._collect()
                break
        while self._on_drain_now is not None and not self._stop.wait(self._period):
            if self.now_path.exists():
                log.info("%s appeared: ending the requests in flight", self.now_path)
                try:
                    self._on_drain_now()
                except Exception:
                    log.exception("ending the requests in flight failed")
                self._collect()
                break

    def _collect(self) -> None:
        """Triton's response factories go when their Python senders are collected: free any
        held in reference cycles now, so nothing keeps the model from unloading."""
        self._stop.wait(0.2)
        gc.collect()

    def close(self) -> None:
        self._stop.set()
