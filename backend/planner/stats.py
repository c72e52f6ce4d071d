"""The statistics the planner, the autoscaler and the benchmarks report, defined once: a
percentile (numpy's default, linear interpolation between the closest ranks; NaN when there are
no values: a figure of nothing is not 0), a median (its 50th percentile), a compact summary of a
sample, and one stream's decode rate."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

NAN = float("nan")


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated; NaN for none."""
    vals = list(values)
    return float(np.percentile(vals, q)) if vals else NAN


def median(values: Iterable[float]) -> float:
    """The 50th percentile; NaN for no values."""
    return percentile(values, 50)


def summary(values: Iterable[float]) -> dict:
    """``{n, mean, p50, p90, p99, max}`` of ``values`` (NaN figures for none)."""
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0, "mean": NAN, "p50": NAN, "p90": NAN, "p99": NAN, "max": NAN}
    p50, p90, p99 = (float(x) for x in np.percentile(vals, [50, 90, 99]))
    return {"n": len(vals), "mean": math.fsum(vals) / len(vals), "p50": p50, "p90": p90, "p99": p99, "max": max(vals)}


def decode_rate(times: Sequence[float]) -> float:
    """One stream's tokens per second after its first token, from the tokens' arrival times;
    NaN for fewer than two tokens."""
    if len(times) < 2 or times[-1] <= times[0]:
        return NAN
    return (len(times) - 1) / (times[-1] - times[0])


def gaps(times: Sequence[float]) -> list[float]:
    """The times between consecutive arrivals."""
    return [b - a for a, b in zip(times, times[1:])]
