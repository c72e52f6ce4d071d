"""The planner's model (``backend/planner/``) put to the autoscaler's use: for a predicted load,
the fewest prefill and decode instances whose simulated SLO attainment reaches the goal, and the
TTFT and inter-token latency the simulator predicts for the deployment as it is (logged beside
what is then measured).

Instances are modelled as separate machines of ``threads`` threads each, as a deployment across
hosts is; on one shared machine that overstates what another instance adds (it gets no cores of
its own), which the measured SLO signals of the policy correct.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from backend.autoscale.predictor import Load
from backend.engine.step_profile import EngineProfile
from backend.planner.simulator import Deployment, InstanceSpec, simulate
from backend.planner.slo import ATTAINMENT_GOAL, SLO, attainment, summary
from backend.planner.workload import poisson


@dataclass(frozen=True)
class Prediction:
    ttft_p90_s: float
    itl_p90_s: float
    attainment: float


class PerformanceModel:
    def __init__(
        self,
        profile: EngineProfile,
        slo: SLO,
        threads: int = 1,
        budget: int = 256,
        max_num_seqs: int = 32,
        kv_tokens: int = 16384,
        horizon_requests: int = 120,
        goal: float = ATTAINMENT_GOAL,
    ):
        profile.cost(threads)  # a KeyError naming the thread counts it has
        self.profile, self.slo, self.goal = profile, slo, goal
        self.spec = (threads, budget, max_num_seqs, kv_tokens)
        self.horizon_requests = horizon_requests

    def _deployment(self, prefill: int, decode: int) -> Deployment:
        t, b, s, kv = self.spec
        pre = tuple(InstanceSpec(t, b, s, kv, machine=i) for i in range(prefill))
        dec = tuple(InstanceSpec(t, b, s, kv, machine=prefill + i) for i in range(decode))
        return Deployment(f"{prefill}P:{decode}D", prefill=pre, decode=dec)

    def _results(self, prefill: int, decode: int, load: Load):
        p = max(1, round(load.prompt_tokens))
        o = max(1, round(load.output_tokens))
        trace = poisson(load.arrivals_per_s, self.horizon_requests, (p, p), (o, o), seed=1)
        return simulate(self._deployment(prefill, decode), self.profile, trace)

    def predict(self, prefill: int, decode: int, load: Load) -> Prediction:
        """What ``prefill`` + ``decode`` instances give at ``load`` (NaN without load or instances)."""
        if load.arrivals_per_s <= 0 or prefill < 1 or decode < 1:
            return Prediction(math.nan, math.nan, math.nan)
        results = self._results(prefill, decode, load)
        s = summary(results)
        ttft = sorted(r.ttft for r in results)
        p90 = ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] if ttft else math.nan
        return Prediction(p90, s["itl_p90"], attainment(results, self.slo))

    def needed(self, load: Load, bounds: dict[str, tuple[int, int]]) -> tuple[int, int, float]:
        """(prefill, decode, attainment): the smallest deployment within ``bounds`` (role ->
        (min, max)) whose simulated attainment at ``load`` reaches the goal; the largest when
        none does. Among equal sizes the one with the higher attainment."""
        (pmin, pmax), (dmin, dmax) = bounds["prefill"], bounds["decode"]
        if load.arrivals_per_s <= 0:
            return pmin, dmin, math.nan
        for total in range(pmin + dmin, pmax + dmax + 1):
            best = None
            for p in range(pmin, pmax + 1):
                d = total - p
                if not dmin <= d <= dmax:
                    continue
                a = attainment(self._results(p, d, load), self.slo)
                if best is None or a > best[2]:
                    best = (p, d, a)
            if best is not None and best[2] >= self.goal:
                return best
        return pmax, dmax, attainment(self._results(pmax, dmax, load), self.slo)
