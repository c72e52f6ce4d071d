"""The load predictor (backend/autoscale/predictor.py): Holt's smoothing of the arrival rate
(exact on a constant rate, ahead of a plain average on a ramp, never negative) and smoothing of
the prompt and output lengths (an interval without requests keeps them)."""

from __future__ import annotations

import math

import pytest

from backend.autoscale.predictor import Load, LoadPredictor


def test_before_any_update_it_predicts_no_load_and_the_default_lengths():
    assert LoadPredictor(prompt_tokens=100, output_tokens=20).predict() == Load(0.0, 100, 20)


def test_a_constant_rate_is_predicted_exactly():
    p = LoadPredictor()
    for _ in range(10):
        p.update(Load(4.0, 512, 128))
    got = p.predict()
    assert got.arrivals_per_s == pytest.approx(4.0)
    assert got.prompt_tokens == pytest.approx(512, rel=1e-2)
    assert got.output_tokens == pytest.approx(128, rel=1e-2)


def test_a_rising_ramp_is_predicted_above_its_last_level():
    p = LoadPredictor(alpha=0.5, beta=0.3)
    flat = LoadPredictor(alpha=0.5, beta=0.0)  # no trend: plain exponential smoothing
    rates = [1.0 + i for i in range(20)]
    for r in rates:
        p.update(Load(r, 256, 64))
        flat.update(Load(r, 256, 64))
    # the trend carries it past the last measured rate, towards the next one (21)
    assert p.predict().arrivals_per_s > rates[-1]
    assert p.predict().arrivals_per_s == pytest.approx(rates[-1] + 1, abs=0.2)
    # plain smoothing trails the ramp
    assert flat.predict().arrivals_per_s < rates[-1]


def test_a_falling_rate_is_never_predicted_negative():
    p = LoadPredictor(alpha=0.9, beta=0.9)
    for r in (50.0, 30.0, 10.0, 0.0, 0.0):
        p.update(Load(r, 256, 64))
        assert p.predict().arrivals_per_s >= 0.0
    assert p.predict().arrivals_per_s == 0.0  # the trend points below zero: clamped
    # a nonsense negative measurement counts as 0
    twin = LoadPredictor(alpha=0.9, beta=0.9)
    for r in (50.0, 30.0, 10.0, 0.0, 0.0):
        twin.update(Load(r, 256, 64))
    p.update(Load(-5.0, 256, 64))
    twin.update(Load(0.0, 256, 64))
    assert p.predict() == twin.predict()
    assert p.predict().arrivals_per_s >= 0.0


def test_an_interval_without_requests_keeps_the_lengths():
    p = LoadPredictor(alpha=0.5, prompt_tokens=256, output_tokens=64)
    p.update(Load(1.0, 1024, 128))
    before = p.predict()
    assert (before.prompt_tokens, before.output_tokens) == (640, 96)
    p.update(Load(0.0, math.nan, math.nan))
    after = p.predict()
    assert (after.prompt_tokens, after.output_tokens) == (640, 96)
    assert not math.isnan(after.arrivals_per_s)


@pytest.mark.parametrize("alpha,beta", [(0.0, 0.3), (1.5, 0.3), (-0.1, 0.3), (0.5, -0.1), (0.5, 1.1)])
def test_bad_smoothing_factors_are_refused(alpha, beta):
    with pytest.raises(ValueError, match="alpha must be in"):
        LoadPredictor(alpha=alpha, beta=beta)
