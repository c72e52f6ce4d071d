"""The statistics and arrival processes the planner, the autoscaler and the benchmarks share
(``backend/planner/stats.py``, ``backend/planner/workload.py``): one percentile definition (NaN
for no values), a summary, a stream's decode rate, and seeded arrivals that are the traces they
were."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from backend.planner import stats, workload


def test_percentile_is_numpys_linear_interpolation_and_nan_for_nothing():
    values = [0.3, 0.1, 0.9, 0.5, 0.7, 0.2]
    for q in (0, 10, 50, 90, 99, 100):
        assert stats.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert stats.median(iter(values)) == pytest.approx(0.4)
    assert math.isnan(stats.percentile([], 50)) and math.isnan(stats.median([]))
    s = stats.summary(values)
    assert s["n"] == 6 and s["max"] == 0.9 and s["mean"] == pytest.approx(sum(values) / 6)
    assert s["p50"] == pytest.approx(0.4) and s["p90"] == pytest.approx(float(np.percentile(values, 90)))
    assert stats.summary([])["n"] == 0 and math.isnan(stats.summary([])["p99"])


def test_decode_rate_counts_the_tokens_after_the_first():
    assert stats.decode_rate([1.0, 1.5, 2.0, 3.0]) == pytest.approx(1.5)
    assert math.isnan(stats.decode_rate([1.0])) and math.isnan(stats.decode_rate([2.0, 2.0]))
    assert stats.gaps([1.0, 1.5, 3.0]) == [0.5, 1.5]


def _old_ramp_trace(phases, prompt_tokens, output_tokens, seed):
    """The ramp trace as perf/autoscale_ramp.py first drew it (the seeded traces stay the same)."""
    rng = random.Random(seed)
    out, start = [], 0.0
    for ph in phases:
        t = start
        while ph.rate > 0:
            t += rng.expovariate(ph.rate)
            if t >= start + ph.duration_s:
                break
            out.append((t, rng.randint(*prompt_tokens), rng.randint(*output_tokens)))
        start += ph.duration_s
    return out


def test_the_ramp_trace_is_the_one_it_was():
    phases = workload.parse_phases("60:0.1,180:0.6,0:5,30:0,210:0.1")
    assert phases[1] == workload.Phase(180.0, 0.6)
    trace = workload.ramp_trace(phases, (32, 384), (16, 48), seed=1)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace] == _old_ramp_trace(
        phases, (32, 384), (16, 48), 1
    )
    assert len(trace) > 50 and all(not 240 <= r.arrival_s < 270 for r in trace)  # the phase of rate 0


def test_a_poisson_workload_draws_each_requests_lengths_after_its_arrival():
    w = workload.poisson(2.0, 20, (8, 16), (2, 4), seed=5)
    rng = random.Random(5)
    want = []
    for t in workload.poisson_arrivals(2.0, rng):
        want.append((t, rng.randint(8, 16), rng.randint(2, 4)))
        if len(want) == 20:
            break
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in w] == want
