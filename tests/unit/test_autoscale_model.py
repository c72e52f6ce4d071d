"""The planner's model as the autoscaler uses it (backend/autoscale/model.py), on a tiny
hand-made profile: the fewest instances for a load, and the latencies predicted for a
deployment (NaN without load). Also one autoscaler interval that consults it."""

from __future__ import annotations

import json
import math

import pytest

from backend.autoscale.autoscaler import Autoscaler
from backend.autoscale.model import PerformanceModel
from backend.autoscale.policy import Policy, PolicyConfig
from backend.autoscale.predictor import Load
from backend.engine.step_profile import EngineProfile, StepSample, ThreadProfile, features
from backend.planner.slo import SLO

# a step costs 10 ms + 2 ms per sequence + 1 ms per new token: a 256-token prompt takes ~0.27 s
COEF = [0.010, 0.002, 0.001, 0.0, 0.0, 0.0]
GRID = [[(1, 64)] * b for b in (1, 2, 4, 8)] + [[(n, 0)] for n in (16, 64, 256)] + [[(1, 128)] * 2 + [(64, 0)]]
SLO_ = SLO(ttft_s=1.0, itl_p90_s=0.1)
BOUNDS = {"prefill": (1, 4), "decode": (1, 4)}


def tiny_profile() -> EngineProfile:
    samples = [StepSample(c, sum(k * f for k, f in zip(COEF, features(c)))) for c in GRID]
    return EngineProfile(
        model="tiny",
        weights_dtype="float32",
        page_size=16,
        threads={1: ThreadProfile(1, samples)},
        corun_slowdown=1.0,
        handoff_s=0.005,
    )


@pytest.fixture(scope="module")
def model() -> PerformanceModel:
    return PerformanceModel(tiny_profile(), SLO_, horizon_requests=60)


def test_a_profile_without_the_thread_count_is_refused():
    with pytest.raises(KeyError, match="no 4-thread"):
        PerformanceModel(tiny_profile(), SLO_, threads=4)


def test_no_load_needs_the_minimum(model):
    p, d, attained = model.needed(Load(0.0, 256, 32), {"prefill": (2, 4), "decode": (1, 4)})
    assert (p, d) == (2, 1) and math.isnan(attained)


def test_more_load_needs_more_instances(model):
    low = model.needed(Load(0.5, 256, 32), BOUNDS)
    high = model.needed(Load(8.0, 256, 32), BOUNDS)
    assert low[:2] == (1, 1) and low[2] >= model.goal
    # one prefill instance computes ~3.7 prompts/s: 8/s needs at least 3
    assert high[0] >= 3 and high[0] + high[1] > 2
    assert high[2] >= model.goal
    # beyond what the bounds allow: the largest deployment, with its (poor) attainment
    p, d, attained = model.needed(Load(50.0, 256, 32), {"prefill": (1, 2), "decode": (1, 2)})
    assert (p, d) == (2, 2) and attained < model.goal


def test_predict_is_nan_without_load_or_instances(model):
    for prefill, decode, rate in ((1, 1, 0.0), (0, 1, 1.0), (1, 0, 1.0)):
        pred = model.predict(prefill, decode, Load(rate, 256, 32))
        assert math.isnan(pred.ttft_p90_s) and math.isnan(pred.itl_p90_s) and math.isnan(pred.attainment)


def test_predict_gets_worse_with_load(model):
    light = model.predict(1, 1, Load(0.5, 256, 32))
    heavy = model.predict(1, 1, Load(8.0, 256, 32))
    assert 0 < light.ttft_p90_s < SLO_.ttft_s and light.attainment == 1.0
    assert heavy.ttft_p90_s > SLO_.ttft_s and heavy.attainment < light.attainment
    assert light.itl_p90_s > 0


class _Empty:
    def members(self, role=None):
        return []


class _Actuator:
    name = "fake"

    def managed(self):
        return []

    def start(self, role):
        raise AssertionError("not expected")

    def stop(self, m):
        raise AssertionError("not expected")


def test_an_interval_records_what_the_model_needs(model, tmp_path):
    policy = Policy(PolicyConfig(slo=SLO_, min_instances={"prefill": 0, "decode": 0}))
    path = tmp_path / "d.jsonl"
    a = Autoscaler(_Empty(), _Actuator(), policy, model=model, decisions_file=path)
    rec = a.step()
    # no load yet: the model needs the minimum, and predicts nothing for no instances
    assert rec.model_needed == {"prefill": 0, "decode": 0, "attainment": None}
    assert rec.model_prediction == {"ttft_p90_s": None, "itl_p90_s": None, "attainment": None}
    line = json.loads(path.read_text())
    assert line["model_needed"]["attainment"] is None
    assert all(d["desired"] == 0 for d in line["decisions"])
