"""``triton-disagg autoscale``: a process of its own that, once an interval, reads the
deployment (membership records and each instance's metrics), predicts the next interval's load,
decides how many prefill and decode instances the SLO needs (``policy.Policy``, with the
planner's model when given a profile) and has its actuator start or drain them.

It holds no state the deployment needs: killed, it leaves every instance as it is, and a new
one starts from the membership. Every decision that changes something is logged with its reason
(and every hold whose reason changed); each interval is one JSON line in ``decisions_file``
(measured, predicted, what the model predicted for the deployment as it is, the decisions);
``/metrics`` exports desired and actual instances per role, decisions, and the predicted and
measured load, TTFT and ITL.

An instance it started counts as *starting* until its record appears; one that has not joined
within ``start_timeout_s`` or whose process exits is stopped and reported to the actuator (which
then prefers another host), and the next interval starts a replacement. A scale-in stops the
serving instance the actuator manages with the fewest requests in flight: it drains (no new
requests; its requests finish, or routers move them with their output), then exits.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from backend.autoscale.actuator import Actuator, ActuatorError, Managed
from backend.autoscale.model import PerformanceModel
from backend.autoscale.policy import ROLES, Decision, Policy
from backend.autoscale.predictor import Load, LoadPredictor
from backend.autoscale.signals import Observation, Scrape, observe, scrape
from backend.cluster.membership import Membership
from backend.cluster.prometheus_text import CONTENT_TYPE, exposition
from backend.cluster.records import InstanceRecord

log = logging.getLogger("triton_disagg.autoscale")


@dataclass
class Interval:
    """One interval's record (a line of the decisions file)."""

    t: float
    current: dict[str, int]
    starting: dict[str, int]
    observed: dict = field(default_factory=dict)
    predicted_load: dict = field(default_factory=dict)
    model_prediction: dict = field(default_factory=dict)  # for the deployment as it now is, next interval
    model_needed: dict = field(default_factory=dict)
    decisions: list[dict] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)


def _clean(d: dict) -> dict:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


class Autoscaler:
    def __init__(
        self,
        membership: Membership,
        actuator: Actuator,
        policy: Policy,
        model: PerformanceModel | None = None,
        interval_s: float = 10.0,
        start_timeout_s: float = 240.0,
        decisions_file: str | Path | None = None,
        predictor: LoadPredictor | None = None,
    ):
        self.membership, self.actuator, self.policy, self.model = membership, actuator, policy, model
        self.interval_s, self.start_timeout_s = interval_s, start_timeout_s
        self.decisions_file = Path(decisions_file) if decisions_file else None
        self.predictor = predictor or LoadPredictor()
        self._last_scrape: dict[str, dict[str, Scrape]] = {r: {} for r in ROLES}
        self._last_t: float | None = None
        self._reported: set[str] = set()
        self._last_reason: dict[str, str] = {}
        self.decisions_total: dict[tuple[str, str], int] = defaultdict(int)
        self.last: Interval | None = None
        self.desired: dict[str, int] = {}
        self._stop = threading.Event()

    # reading the deployment

    def _serving(self) -> dict[str, list[InstanceRecord]]:
        records = self.membership.members()
        return {role: [r for r in records if r.role == role and not r.draining] for role in ROLES}

    def _starting(self, serving: dict[str, list[InstanceRecord]], managed: list[Managed], now: float) -> dict[str, int]:
        urls = {r.grpc_url for rs in serving.values() for r in rs}
        starting = {r: 0 for r in ROLES}
        for m in managed:
            if m.role not in starting or m.stopping:
                continue
            if not m.alive:
                if m.id not in self._reported:
                    self._reported.add(m.id)
                    log.warning(
                        "autoscale: %s instance %s on %s exited (code %s) without being stopped; the next interval "
                        "replaces it elsewhere if needed. Its log ends: %s",
                        m.role,
                        m.id,
                        m.where,
                        m.exit_code,
                        m.detail.strip()[-300:],
                    )
                    self._start_failed(m.where)
                continue
            if m.grpc_url in urls:
                continue
            if time.time() - m.started_at > self.start_timeout_s:
                log.warning(
                    "autoscale: %s instance %s on %s has not joined the membership %.0f s after its start; stopping it",
                    m.role,
                    m.id,
                    m.where,
                    time.time() - m.started_at,
                )
                self._start_failed(m.where)
                try:
                    self.actuator.stop(m)
                except ActuatorError as e:
                    log.warning("autoscale: %s", e)
                continue
            starting[m.role] += 1
        return starting

    def _start_failed(self, where: str) -> None:
        self.actuator.start_failed(where)

    def _scrape(self, records: list[InstanceRecord]) -> dict[str, Scrape]:
        by_url: dict[str, list[InstanceRecord]] = defaultdict(list)
        for r in records:
            if r.metrics_url:
                by_url[r.metrics_url].append(r)
        out: dict[str, Scrape] = {}
        for url, rs in by_url.items():
            try:
                got = scrape(url, [r.model for r in rs])
            except Exception as e:  # one unreachable server must not stop the others' figures
                log.warning("autoscale: cannot read metrics at %s: %s", url, e)
                continue
            for r in rs:
                out[r.name] = got[r.model]
        return out

    # one interval

    def step(self) -> Interval:
        now = time.monotonic()
        serving = self._serving()
        listed = True
        try:
            managed = self.actuator.managed()
        except ActuatorError as e:
            log.warning("autoscale: cannot list the managed instances (%s): holding this interval", e)
            managed, listed = [], False
        starting = self._starting(serving, managed, now)
        current = {r: len(serving[r]) + starting[r] for r in ROLES}
        scrapes = {r: self._scrape(serving[r]) for r in ROLES}
        dt = now - self._last_t if self._last_t is not None else 0.0
        first = self._last_t is None
        obs = {r: observe(r, dt, scrapes[r], self._last_scrape[r]) for r in ROLES}
        self._last_scrape, self._last_t = scrapes, now
        rec = Interval(t=time.time(), current=current, starting=starting)
        rec.observed = {r: _clean(asdict(o)) for r, o in obs.items()}
        decode_obs = obs["decode"] if not first else Observation("decode", len(scrapes["decode"]), 0.0)
        if not first:
            self.predictor.update(Load(decode_obs.arrivals_per_s, decode_obs.prompt_tokens, decode_obs.output_tokens))
        predicted = self.predictor.predict()
        rec.predicted_load = asdict(predicted)
        needed = None
        if self.model is not None:
            n_pre, n_dec, attained = self.model.needed(predicted, self.policy.config.bounds())
            needed = {"prefill": n_pre, "decode": n_dec}
            rec.model_needed = _clean({**needed, "attainment": attained})
            pred = self.model.predict(len(serving["prefill"]), len(serving["decode"]), predicted)
            rec.model_prediction = _clean(asdict(pred))
        decisions = self.policy.decide(now, current, starting, decode_obs, predicted, needed)
        if not listed:  # what is starting is unknown: change nothing this interval
            decisions = [
                Decision(d.role, d.current, d.current, "hold: the actuator's instances are unknown") for d in decisions
            ]
        rec.decisions = [asdict(d) for d in decisions]
        self.desired = {d.role: d.desired for d in decisions}
        for d in decisions:
            self.decisions_total[(d.role, d.direction)] += 1
            if d.direction == "hold":
                if d.reason != "hold" and self._last_reason.get(d.role) != d.reason:
                    log.info("autoscale: %s stays at %d: %s", d.role, d.current, d.reason)
                self._last_reason[d.role] = d.reason
                continue
            self._last_reason[d.role] = d.reason
            log.info("autoscale: %s %d -> %d: %s", d.role, d.current, d.desired, d.reason)
            rec.actions += self._act(d, serving, managed, scrapes, now)
        self.last = rec
        if self.decisions_file is not None:
            with self.decisions_file.open("a") as f:
                f.write(json.dumps(asdict(rec)) + "\n")
        return rec

    def _act(
        self,
        d: Decision,
        serving: dict[str, list[InstanceRecord]],
        managed: list[Managed],
        scrapes: dict[str, dict[str, Scrape]],
        now: float,
    ) -> list[str]:
        done: list[str] = []
        acted = False
        if d.desired > d.current:
            for _ in range(d.desired - d.current):
                try:
                    m = self.actuator.start(d.role)
                    done.append(f"started {d.role} {m.id} on {m.where}")
                    acted = True
                except ActuatorError as e:
                    log.error("autoscale: could not start a %s instance: %s", d.role, e)
                    done.append(f"start of a {d.role} instance failed: {e}")
                    break
        else:
            records = {r.grpc_url: r for r in serving[d.role]}
            candidates = [
                m for m in managed if m.role == d.role and m.alive and not m.stopping and m.grpc_url in records
            ]

            def active(m: Managed) -> float:
                s = scrapes[d.role].get(records[m.grpc_url].name)
                return s.values.get("requests_active", 0.0) if s else 0.0

            for m in sorted(candidates, key=lambda m: (active(m), -m.started_at))[: d.current - d.desired]:
                try:
                    self.actuator.stop(m)
                    acted = True
                    done.append(f"draining {d.role} {m.id} on {m.where} ({active(m):.0f} requests in flight)")
                    log.info("autoscale: draining %s instance %s on %s (%s)", d.role, m.id, m.where, m.grpc_url)
                except ActuatorError as e:
                    log.error("autoscale: could not stop %s: %s", m.id, e)
                    done.append(f"stop of {m.id} failed: {e}")
            if not candidates:
                log.warning(
                    "autoscale: cannot scale %s in: none of its serving instances is managed by the %s actuator",
                    d.role,
                    self.actuator.name,
                )
                done.append(f"no {d.role} instance managed by {self.actuator.name} to stop")
        if acted:
            self.policy.changed(d.role, now)
        return done

    def run(self) -> None:
        """Step every ``interval_s`` until ``stop()``."""
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.step()
            except Exception:
                log.exception("autoscale: interval failed; the deployment is left as it is")
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def stop(self) -> None:
        self._stop.set()

    # metrics

    def exposition(self) -> str:
        """``triton_disagg_autoscaler_*`` in Prometheus text (``backend/cluster/prometheus_text.py``)."""

        def family(name: str, kind: type, help_: str, labels: list[str], samples) -> GaugeMetricFamily:
            f = kind(f"triton_disagg_autoscaler_{name}", help_, labels=labels)
            for values, value in samples:
                f.add_metric(values, float(value))
            return f

        rec = self.last
        families = [
            family(
                "desired_instances",
                GaugeMetricFamily,
                "instances per role the last decision wants",
                ["role"],
                [([r], self.desired.get(r, 0)) for r in ROLES],
            ),
            family(
                "actual_instances",
                GaugeMetricFamily,
                "instances per role serving or starting",
                ["role"],
                [([r], rec.current[r] if rec else 0) for r in ROLES],
            ),
            family(
                "starting_instances",
                GaugeMetricFamily,
                "instances per role started and not yet in the membership",
                ["role"],
                [([r], rec.starting[r] if rec else 0) for r in ROLES],
            ),
            family(
                "decisions_total",
                CounterMetricFamily,
                "decisions per role and direction (up, down, hold)",
                ["role", "direction"],
                [([r, k], n) for (r, k), n in sorted(self.decisions_total.items())],
            ),
        ]
        if rec is not None:
            o = rec.observed.get("decode", {})
            figures = ("arrivals_per_s", "ttft_p90_s", "itl_p90_s", "prefill_queue_p90_s")
            families.append(
                family(
                    "observed",
                    GaugeMetricFamily,
                    "the last interval's measured figures (decode instances)",
                    ["figure"],
                    [([k], o[k] if o.get(k) is not None else math.nan) for k in figures],
                )
            )
            families.append(
                family(
                    "predicted",
                    GaugeMetricFamily,
                    "the next interval's predicted load and, with a profile, latencies",
                    ["figure"],
                    [
                        ([k], v if v is not None else math.nan)
                        for k, v in {**rec.predicted_load, **rec.model_prediction}.items()
                    ],
                )
            )
        return exposition(families)


def serve_metrics(autoscaler: Autoscaler, host: str, port: int) -> threading.Thread:
    """``GET /metrics`` (Prometheus text) and ``GET /status`` (the last interval) on a thread."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse

    api = FastAPI(title="triton-disagg autoscaler")

    @api.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(autoscaler.exposition(), media_type=CONTENT_TYPE)

    @api.get("/status")
    async def status() -> JSONResponse:
        return JSONResponse(asdict(autoscaler.last) if autoscaler.last else {})

    server = uvicorn.Server(uvicorn.Config(api, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="autoscaler-metrics", daemon=True)
    thread.start()
    return thread
