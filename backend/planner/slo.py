"""SLO attainment and goodput, for the planner's simulated requests and the benchmarks' measured
ones: the share of requests that complete with TTFT <= T and the p90 of their inter-token gaps
<= I, and the highest request rate at which that share is at least the goal (90% by default),
searched (``goodput``) or read off measured rates (``measured_goodput``). Percentiles of no
values are NaN (``backend/planner/stats.py``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from backend.planner.simulator import RequestResult
from backend.planner.stats import percentile

ATTAINMENT_GOAL = 0.9


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    itl_p90_s: float

    def attained(self, completed: bool, ttft: float, gaps: list[float]) -> bool:
        """Complete, TTFT within its bound and the p90 of the gaps within theirs (a one-token
        answer has no gaps, and so meets the second)."""
        return completed and ttft <= self.ttft_s and (not gaps or percentile(gaps, 90) <= self.itl_p90_s)

    def met(self, res: RequestResult) -> bool:
        return self.attained(res.completed, res.ttft, res.gaps)


def attainment(results: list[RequestResult], slo: SLO) -> float:
    return sum(slo.met(r) for r in results) / len(results) if results else math.nan


def summary(results: list[RequestResult]) -> dict:
    """TTFT p50 and p90 of all requests, and p50/p90 of all their inter-token gaps pooled."""
    ttft = [r.ttft for r in results if r.token_times]
    gaps = [g for r in results for g in r.gaps]
    return {
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "itl_p50": percentile(gaps, 50),
        "itl_p90": percentile(gaps, 90),
        "completed": sum(r.completed for r in results),
        "requests": len(results),
    }


def measured_goodput(points: dict[float, float], goal: float = ATTAINMENT_GOAL) -> float:
    """Highest measured rate such that every rate up to it attains ``goal`` (``points``: rate ->
    attainment); 0 if the lowest does not."""
    best = 0.0
    for rate in sorted(points):
        if points[rate] < goal:
            break
        best = rate
    return best


def goodput(
    attained_at: Callable[[float], float],
    start_rate: float,
    goal: float = ATTAINMENT_GOAL,
    max_rate: float = 1e4,
    rel_precision: float = 0.02,
) -> float:
    """Highest rate with ``attained_at(rate) >= goal``, assuming attainment falls as the rate
    rises: doubling from ``start_rate`` (halving if it already misses) brackets it, bisection
    narrows it. 0 if even ``start_rate / 1024`` misses."""
    lo, hi = None, None
    rate = start_rate
    if attained_at(rate) >= goal:
        lo = rate
        while hi is None:
            rate *= 2
            if rate > max_rate:
                return lo
            if attained_at(rate) >= goal:
                lo = rate
            else:
                hi = rate
    else:
        hi = rate
        while lo is None:
            rate /= 2
            if rate < start_rate / 1024:
                return 0.0
            if attained_at(rate) >= goal:
                lo = rate
            else:
                hi = rate
    while (hi - lo) / lo > rel_precision:
        mid = (lo + hi) / 2
        if attained_at(mid) >= goal:
            lo = mid
        else:
            hi = mid
    return lo
