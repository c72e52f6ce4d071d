"""The front model's decode models: an explicit health state per model, from probes, and the
requests in flight on each.

Every ``health_probe_interval_s`` each decode model gets a control request (``health_probe``)
on its own thread; it answers with an empty final response while it can serve. A probe that
errs (a dead stub answers "not healthy", a decode instance without a prefill connection or a
lost tensor-parallel rank answers "out of service"; a draining one answers "draining": it gets
no new requests, and its requests in flight go on) or stays unanswered for
``health_probe_timeout_s`` is a failure; once the model has answered a probe (before that,
while the server starts, it is presumed serving), ``health_probe_failures`` in a row mark it
DOWN: it gets no new requests, and the requests in flight on it fail at once with
"unavailable" (a dead instance would never answer them). One successful probe marks it UP.
Routing: a probe's answer carries the decode model's cache summary (``instance_state``); the
:class:`KVRouter` picks among the UP models by the prompt pages each holds and the pages of the
requests in flight on each (``backend/serving/kv_router.py``, which also says what can go stale).
A model that goes DOWN is forgotten by the router: it may come back with an empty cache.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from backend.engine.cache_summary import CacheSummary
from backend.engine.outputs import ErrorKind
from backend.serving.config import FrontConfig
from backend.serving.errors import parse_error
from backend.serving.kv_router import KVRouter
from backend.serving.tensors import STATE_OUTPUT

log = logging.getLogger("triton_disagg.front")


@dataclass
class TargetState:
    name: str
    up: bool = True  # presumed until it answers (Triton's readiness covers the start)
    seen_up: bool = False  # answered a probe once: from then on failures can take it down
    failures: int = 0  # consecutive failed probes
    draining: bool = False  # answers its probes "draining": no new requests, its own ones go on
    reason: str = ""
    probing_since: float | None = None  # a probe is outstanding since
    inflight: set = field(default_factory=set)  # the front's requests forwarded to it


class DecodeTargets:
    """``pick()`` a model for a new request (None: none is UP), ``done()`` when it ends;
    ``on_down(name, reason, requests)`` runs when a model goes DOWN with the requests it had."""

    def __init__(self, pb_utils, config: FrontConfig, on_down: Callable[[str, str, list], None]):
        self.pb, self.config, self._on_down = pb_utils, config, on_down
        self.states = {t: TargetState(t) for t in config.targets()}
        self.router = KVRouter(config.kv_routing_weight)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe_loop, name="front-probes", daemon=True)

    def start(self) -> None:
        """Begin probing. Call it when the front model's ``initialize`` is done: a probe (a BLS
        request) sent while the calling model still initializes took tritonserver down."""
        self._thread.start()

    # ------------------------------------------------------------ routing
    def pick(self, request, token_ids: list[int], request_pages: int, exclude: str | None = None) -> str | None:
        """The UP model (not ``exclude``) the router prefers for the prompt ``token_ids`` (empty:
        by load alone); ``request_pages``: the pages it will hold there."""
        with self._lock:
            up = [s.name for s in self.states.values() if s.up and not s.draining and s.name != exclude]
            target = self.router.pick(request, token_ids, up, request_pages)
            if target is not None:
                self.states[target].inflight.add(request)
            return target

    def done(self, target: str, request) -> None:
        with self._lock:
            self.states[target].inflight.discard(request)
        self.router.done(target, request)

    def page_size(self) -> int:
        """The decode models' KV page size, as they report it."""
        return self.router.page_size()

    def router_counters(self) -> dict[str, int]:
        """Prompt tokens routed, and how many the chosen models were judged to cache."""
        return dict(self.router.counters)

    def all_inflight(self) -> list:
        with self._lock:
            return [r for s in self.states.values() for r in s.inflight]

    def down_reasons(self) -> str:
        with self._lock:
            return "; ".join(f"{s.name}: {s.reason}" for s in self.states.values() if not s.up)

    # ------------------------------------------------------------ probes
    def _probe_loop(self) -> None:
        interval, timeout = self.config.health_probe_interval_s, self.config.health_probe_timeout_s
        while not self._stop.wait(interval):
            now = time.monotonic()
            for state in list(self.states.values()):
                with self._lock:
                    since = state.probing_since
                    if since is None:
                        state.probing_since = now
                if since is None:
                    threading.Thread(target=self._probe, args=(state.name,), daemon=True).start()
                elif now - since > timeout:  # still unanswered: a failure per interval until it returns
                    self.mark_failed(state.name, f"health probe unanswered for {now - since:.0f}s")

    def _probe(self, target: str) -> None:
        pb = self.pb
        error = None
        try:
            probe = pb.Tensor("health_probe", np.array([True], dtype=bool))
            for resp in pb.InferenceRequest(
                model_name=target, inputs=[probe], requested_output_names=[STATE_OUTPUT.name]
            ).exec(decoupled=True):
                if resp.has_error():
                    error = resp.error().message()
                else:
                    self._read_state(target, pb.get_output_tensor_by_name(resp, STATE_OUTPUT.name))
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        with self._lock:
            self.states[target].probing_since = None
        if error is None:
            self._succeeded(target)
        elif parse_error(error)[0] is ErrorKind.DRAINING:
            self._draining(target, error)
        else:
            self.mark_failed(target, error)

    def _read_state(self, target: str, tensor) -> None:
        if tensor is None:
            return  # the final (empty) response, or a decode model that does not report
        try:
            raw = tensor.as_numpy().reshape(-1)[0]
            self.router.update(target, CacheSummary.from_json(json.loads(raw)))
        except ValueError as e:
            log.warning("decode model %s: unreadable instance_state (%s); routing by load there", target, e)

    def _draining(self, target: str, reason: str) -> None:
        with self._lock:
            state = self.states[target]
            began = not state.draining
            state.draining, state.up, state.seen_up, state.failures, state.reason = True, True, True, 0, reason
        if began:
            log.warning("decode model %s drains (%s); no new requests go there", target, reason)

    def _succeeded(self, target: str) -> None:
        with self._lock:
            state = self.states[target]
            came_back = not state.up or state.draining
            state.up, state.seen_up, state.failures, state.reason = True, True, 0, ""
            state.draining = False
        if came_back:
            log.warning("decode model %s serves again; routing to it", target)

    def mark_failed(self, target: str, reason: str) -> None:
        """A failed probe (or a request the model did not take): counts toward DOWN."""
        with self._lock:
            state = self.states[target]
            state.failures += 1
            state.reason = reason
            went_down = state.up and state.seen_up and state.failures >= self.config.health_probe_failures
            if went_down:
                state.up = False
                lost, state.inflight = list(state.inflight), set()
                self.router.forget(target)
        if went_down:
            log.error(
                "decode model %s is down (%s); routing around it, failing its %d request(s)", target, reason, len(lost)
            )
            self._on_down(target, reason, lost)

    def gauges(self) -> dict[str, float]:
        with self._lock:
            return {name: float(s.up) for name, s in self.states.items()}

    def close(self) -> None:
        self._stop.set()
