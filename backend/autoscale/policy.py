"""How many prefill and decode instances to run next: the autoscaler's decisions, each with its
reason, from one interval's measurements, the predicted load and (with a profile) the planner's
model. Pure: no clock, no I/O; the caller passes the time.

Scale out a role (one at a time, or straight to what the model says is needed) when
- the SLO is threatened: the interval's TTFT p90 above ``threatened`` x the TTFT SLO sends
  prefill up when the prefill queue holds a real share of it (p90 at least ``queue_share`` of the
  SLO) and decode up otherwise; the inter-token p90 above ``threatened`` x the ITL SLO, or the
  decode KV pools fuller than ``kv_high``, sends decode up;
- or the model says the predicted load needs more of it.
A threatened SLO in an interval in which nothing arrived holds: its latency is that of requests
already placed on their instances (a backlog being served), which a new instance would not take.
Scale in a role by one when, for ``scale_in_intervals`` intervals in a row, its latency stayed
under ``low_water`` x the SLO (no queue, KV pools under half full), and the predicted load is
below ``scale_in_rate_fraction`` of the rate at which it last had to grow past that size (or,
with a model, the model says fewer suffice).

Safety: never below a role's minimum nor above its maximum (a deployment outside them is brought
back first); no scale-out of a role while one of its instances is still starting; after any
change no scale-in for ``cooldown_s``, and no further scale-out of the changed role for
``up_cooldown_s`` (a new instance needs that long to show in the figures).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from backend.autoscale.predictor import Load
from backend.autoscale.signals import Observation
from backend.planner.slo import SLO

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class PolicyConfig:
    slo: SLO
    min_instances: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    max_instances: dict[str, int] = field(default_factory=lambda: {"prefill": 2, "decode": 2})
    threatened: float = 0.9
    queue_share: float = 0.25
    kv_high: float = 0.9
    low_water: float = 0.5
    scale_in_intervals: int = 3
    scale_in_rate_fraction: float = 0.6
    cooldown_s: float = 60.0
    up_cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        for role in ROLES:
            lo, hi = self.min_instances.get(role), self.max_instances.get(role)
            if lo is None or hi is None or lo < 0 or hi < max(lo, 1):
                raise ValueError(f"{role}: need 0 <= min <= max and max >= 1, got min {lo}, max {hi}")
        if self.slo.ttft_s <= 0 or self.slo.itl_p90_s <= 0:
            raise ValueError("the SLO's TTFT and ITL must be positive")
        if self.scale_in_intervals < 1:
            raise ValueError("scale_in_intervals must be at least 1")

    def bounds(self) -> dict[str, tuple[int, int]]:
        return {r: (self.min_instances[r], self.max_instances[r]) for r in ROLES}


@dataclass(frozen=True)
class Decision:
    role: str
    current: int
    desired: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"


def _fmt(x: float, unit: str = "s") -> str:
    return "n/a" if math.isnan(x) else f"{x:.3f} {unit}"


class Policy:
    """``decide(...)`` once an interval; it remembers the comfortable streaks, the last changes
    and the rates that made each role grow."""

    def __init__(self, config: PolicyConfig):
        self.config = config
        self._comfortable = {r: 0 for r in ROLES}
        self._last_change: dict[str, float] = {}
        self._grew_at: dict[tuple[str, int], float] = {}  # (role, size it grew from) -> arrival rate

    def changed(self, role: str, now: float) -> None:
        """Tell the policy a change of ``role`` was carried out at ``now``."""
        self._last_change[role] = now
        self._comfortable = {r: 0 for r in ROLES}

    def decide(
        self,
        now: float,
        current: dict[str, int],
        starting: dict[str, int],
        decode_obs: Observation,
        predicted: Load,
        needed: dict[str, int] | None = None,
    ) -> list[Decision]:
        """One decision per role (``hold`` when nothing changes). ``current``: instances per role
        (starting ones included), ``starting``: those not yet serving, ``decode_obs``: the decode
        instances' interval (TTFT there includes the prefill), ``needed``: the model's answer."""
        c = self.config
        slo = c.slo
        o = decode_obs
        ttft_hot = o.ttft_p90_s > c.threatened * slo.ttft_s
        queue_hot = o.prefill_queue_p90_s >= c.queue_share * slo.ttft_s
        itl_hot = o.itl_p90_s > c.threatened * slo.itl_p90_s
        kv_hot = o.kv_used_fraction > c.kv_high
        threatened = {
            "prefill": (
                f"TTFT p90 {_fmt(o.ttft_p90_s)} > {c.threatened:g} x SLO {slo.ttft_s:g} s with prefill queue p90 "
                f"{_fmt(o.prefill_queue_p90_s)}"
                if ttft_hot and queue_hot
                else ""
            ),
            "decode": (
                f"ITL p90 {_fmt(o.itl_p90_s)} > {c.threatened:g} x SLO {slo.itl_p90_s:g} s"
                if itl_hot
                else f"KV pools {o.kv_used_fraction:.0%} used"
                if kv_hot
                else f"TTFT p90 {_fmt(o.ttft_p90_s)} > {c.threatened:g} x SLO {slo.ttft_s:g} s with little prefill "
                f"queue (p90 {_fmt(o.prefill_queue_p90_s)}): the decode side is the bottleneck"
                if ttft_hot and not queue_hot
                else ""
            ),
        }
        below = lambda x, bound: math.isnan(x) or x < bound  # noqa: E731
        comfortable = {
            "prefill": below(o.ttft_p90_s, c.low_water * slo.ttft_s)
            and below(o.prefill_queue_p90_s, c.low_water * c.queue_share * slo.ttft_s),
            "decode": below(o.itl_p90_s, c.low_water * slo.itl_p90_s)
            and below(o.ttft_p90_s, c.low_water * slo.ttft_s)
            and o.kv_used_fraction < 0.5
            and o.requests_waiting_kv == 0,
        }
        load = (
            f"arrivals {o.arrivals_per_s:.2f}/s, predicted {predicted.arrivals_per_s:.2f}/s "
            f"({predicted.prompt_tokens:.0f} prompt, {predicted.output_tokens:.0f} output tokens)"
        )
        out = []
        for role in ROLES:
            n, lo, hi = current[role], c.min_instances[role], c.max_instances[role]
            self._comfortable[role] = self._comfortable[role] + 1 if comfortable[role] else 0
            since = now - self._last_change.get(role, -math.inf)
            since_any = now - max(self._last_change.values(), default=-math.inf)
            want = needed.get(role) if needed else None
            if n < lo:
                out.append(Decision(role, n, lo, f"below the minimum of {lo}"))
                continue
            if n > hi:
                out.append(Decision(role, n, hi, f"above the maximum of {hi}"))
                continue
            backlog = threatened[role] if o.arrivals_per_s <= 0 else ""
            up_reason = (threatened[role] if not backlog else "") or (
                f"the model needs {want} for the predicted load" if want is not None and want > n else ""
            )
            if backlog and not up_reason:
                out.append(
                    Decision(
                        role, n, n, f"hold: nothing arrived in the interval, the latency is a backlog's; {backlog}"
                    )
                )
                continue
            if up_reason:
                if n >= hi:
                    out.append(Decision(role, n, n, f"hold at the maximum {hi}: {up_reason}; {load}"))
                elif starting.get(role, 0):
                    out.append(Decision(role, n, n, f"hold: {starting[role]} starting; {up_reason}"))
                elif since < c.up_cooldown_s:
                    out.append(
                        Decision(role, n, n, f"hold: cooling down ({since:.0f} s since the last change); {up_reason}")
                    )
                else:
                    desired = min(hi, max(n + 1, want or 0))
                    self._grew_at[(role, n)] = max(o.arrivals_per_s, predicted.arrivals_per_s)
                    out.append(Decision(role, n, desired, f"{up_reason}; {load}"))
                continue
            if n > lo and self._comfortable[role] >= c.scale_in_intervals and since_any >= c.cooldown_s:
                grew = self._grew_at.get((role, n - 1))
                if want is not None:
                    ok, why = want < n, f"the model needs {want}"
                elif grew:  # a rate of 0 records no load to fall below
                    ok = predicted.arrivals_per_s < c.scale_in_rate_fraction * grew
                    why = (
                        f"predicted {predicted.arrivals_per_s:.2f}/s vs {c.scale_in_rate_fraction:g} x the "
                        f"{grew:.2f}/s that made it grow past {n - 1}"
                    )
                else:
                    ok, why = True, "no record of needing more"
                if ok:
                    out.append(
                        Decision(
                            role,
                            n,
                            n - 1,
                            f"{self._comfortable[role]} intervals under {c.low_water:g} x the SLO "
                            f"(TTFT p90 {_fmt(o.ttft_p90_s)}, ITL p90 {_fmt(o.itl_p90_s)}); {why}; {load}",
                        )
                    )
                    continue
            out.append(Decision(role, n, n, "hold"))
        return out
