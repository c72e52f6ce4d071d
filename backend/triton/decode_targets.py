"""The front model's decode models as the routing core sees them (``backend/serving/routing.py``,
shared with the OpenAI frontend: health, the KV-aware pick, moves): this file sends the probes.

Every ``health_probe_interval_s`` (every 0.1 s while a model has never passed one) each decode
model gets a control request (``health_probe``) on its own thread; it answers with an empty
final response, carrying its cache summary (``instance_state``), while it can serve. A probe that
errs (a dead stub answers "not healthy", a decode instance without a prefill connection or a
lost tensor-parallel rank answers "out of service") or stays unanswered for
``health_probe_timeout_s`` is a failure; a draining one answers "draining": it gets no new
requests, and its requests in flight go on. The core decides when a model is up or down; the
requests in flight on one that goes down go to ``on_lost``, which moves them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from backend.engine.cache_summary import CacheSummary
from backend.engine.outputs import ErrorKind
from backend.serving.config import FrontConfig
from backend.serving.errors import parse_error
from backend.serving.routing import Journey, RoutingTable
from backend.serving.tensors import STATE_OUTPUT

log = logging.getLogger("triton_disagg.front")


class DecodeTargets:
    """The routing core over the ``decode_models`` (``table``) and their probes;
    ``on_lost(name, reason, requests)`` runs when a model goes down with the requests it had."""

    def __init__(self, pb_utils, config: FrontConfig, on_lost: Callable[[str, str, list[Journey]], None]):
        self.pb, self.config, self._on_lost = pb_utils, config, on_lost
        self.table = RoutingTable(config, log, noun="decode model")
        for name in config.targets():
            self.table.join(name)
        self._probing: dict[str, float] = {}  # name -> when its outstanding probe was sent
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe_loop, name="front-probes", daemon=True)

    def start(self) -> None:
        """Begin probing. Call it when the front model's ``initialize`` is done: a probe (a BLS
        request) sent while the calling model still initializes took tritonserver down."""
        self._thread.start()

    def failed(self, name: str, why: str) -> None:
        """A failed probe of ``name``, or a stream it ended that was not the request's fault."""
        lost = self.table.failed(name, why)
        if lost:
            self._on_lost(name, why, lost)

    # ------------------------------------------------------------ probes
    def _probe_loop(self) -> None:
        timeout = self.config.health_probe_timeout_s
        if self._stop.wait(self.config.health_probe_interval_s):  # let the front's initialize return
            return
        while True:
            now = time.monotonic()
            for name in self.table.names():
                with self._lock:
                    since = self._probing.setdefault(name, now)
                if since == now:
                    threading.Thread(target=self._probe, args=(name,), daemon=True).start()
                elif now - since > timeout:  # still unanswered: a failure per round until it returns
                    self.failed(name, f"health probe unanswered for {now - since:.0f}s")
            if self._stop.wait(self.table.probe_interval()):
                return

    def _probe(self, name: str) -> None:
        pb = self.pb
        error, summary = None, None
        try:
            probe = pb.Tensor("health_probe", np.array([True], dtype=bool))
            for resp in pb.InferenceRequest(
                model_name=name, inputs=[probe], requested_output_names=[STATE_OUTPUT.name]
            ).exec(decoupled=True):
                if resp.has_error():
                    error = resp.error().message()
                else:
                    summary = _read_state(name, pb.get_output_tensor_by_name(resp, STATE_OUTPUT.name)) or summary
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        with self._lock:
            self._probing.pop(name, None)
        if error is not None and parse_error(error)[0] is not ErrorKind.DRAINING:
            self.failed(name, error)
        else:
            self.table.probed(name, summary, error, draining=error is not None)

    def gauges(self) -> dict[str, float]:
        """1 for each decode model the front routes new requests to, else 0."""
        return {s.name: float(s.serving) for s in self.table.status()}

    def close(self) -> None:
        self._stop.set()


def _read_state(name: str, tensor) -> CacheSummary | None:
    if tensor is None:
        return None  # the final (empty) response, or a decode model that does not report
    try:
        return CacheSummary.from_json(json.loads(tensor.as_numpy().reshape(-1)[0]))
    except ValueError as e:
        log.warning("decode model %s: unreadable instance_state (%s); routing by load there", name, e)
        return None
