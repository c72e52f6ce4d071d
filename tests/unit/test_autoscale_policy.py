"""The autoscaler's decisions (backend/autoscale/policy.py): bounds first, scale-out on a
threatened SLO (which role by where the TTFT goes), holds while starting, at the maximum or
cooling down, scale-in only after a comfortable streak, a cooldown and a load well below what
made the role grow (no flapping), and the model's answer when one is given."""

from __future__ import annotations

import math

import pytest

from backend.autoscale.policy import Decision, Policy, PolicyConfig
from backend.autoscale.predictor import Load
from backend.autoscale.signals import Observation
from backend.planner.slo import SLO

SLO_ = SLO(ttft_s=1.0, itl_p90_s=0.1)

HOT_ITL = 0.2  # > 0.9 x 0.1
CALM_ITL = 0.02  # < 0.5 x 0.1


def config(**changes) -> PolicyConfig:
    kw = dict(slo=SLO_, min_instances={"prefill": 1, "decode": 1}, max_instances={"prefill": 3, "decode": 3})
    kw.update(changes)
    return PolicyConfig(**kw)


def obs(**figures) -> Observation:
    """An interval's figures; one request a second arrived unless said otherwise."""
    return Observation("decode", 1, 10.0, **{"arrivals_per_s": 1.0, **figures})


def calm(rate: float = 1.0) -> Observation:
    return obs(arrivals_per_s=rate, ttft_p90_s=0.1, itl_p90_s=CALM_ITL, prefill_queue_p90_s=0.001)


def load(rate: float = 1.0) -> Load:
    return Load(rate, 256, 64)


def decide(
    policy: Policy,
    now: float,
    prefill: int,
    decode: int,
    o: Observation,
    predicted: Load | None = None,
    starting: dict | None = None,
    needed: dict | None = None,
) -> dict[str, Decision]:
    out = policy.decide(
        now, {"prefill": prefill, "decode": decode}, starting or {}, o, predicted or load(o.arrivals_per_s), needed
    )
    assert [d.role for d in out] == ["prefill", "decode"]
    return {d.role: d for d in out}


# configuration


def test_config_refuses_min_above_max_naming_the_role():
    with pytest.raises(ValueError, match=r"decode: need 0 <= min <= max.*min 3, max 2"):
        config(min_instances={"prefill": 1, "decode": 3}, max_instances={"prefill": 3, "decode": 2})
    with pytest.raises(ValueError, match="prefill"):
        config(max_instances={"prefill": 0, "decode": 2}, min_instances={"prefill": 0, "decode": 1})
    with pytest.raises(ValueError, match="prefill"):
        config(min_instances={"decode": 1}, max_instances={"prefill": 1, "decode": 1})
    with pytest.raises(ValueError, match="SLO"):
        config(slo=SLO(0.0, 0.1))
    with pytest.raises(ValueError, match="scale_in_intervals"):
        config(scale_in_intervals=0)
    assert config().bounds() == {"prefill": (1, 3), "decode": (1, 3)}


# bounds


def test_below_the_minimum_goes_to_the_minimum_and_above_the_maximum_to_the_maximum():
    p = Policy(config(min_instances={"prefill": 1, "decode": 2}))
    d = decide(p, 0.0, 0, 0, obs())
    assert (d["prefill"].desired, d["decode"].desired) == (1, 2)
    assert d["decode"].reason == "below the minimum of 2"
    assert d["decode"].direction == "up"
    d = decide(p, 0.0, 5, 1, obs(itl_p90_s=HOT_ITL))
    assert d["prefill"].desired == 3 and "above the maximum of 3" in d["prefill"].reason
    assert d["prefill"].direction == "down"


# scale-out


def test_itl_threatened_sends_decode_up_with_the_reason():
    d = decide(Policy(config()), 0.0, 1, 1, obs(itl_p90_s=0.095, ttft_p90_s=0.2))
    assert d["decode"].direction == "up" and d["decode"].desired == 2
    assert "ITL p90 0.095 s" in d["decode"].reason and "SLO 0.1 s" in d["decode"].reason
    assert d["prefill"].direction == "hold"


def test_full_kv_pools_send_decode_up():
    d = decide(Policy(config()), 0.0, 1, 1, obs(kv_used_fraction=0.95))
    assert d["decode"].desired == 2 and "KV pools 95% used" in d["decode"].reason


def test_ttft_threatened_with_a_prefill_queue_sends_prefill_up():
    d = decide(Policy(config()), 0.0, 1, 1, obs(ttft_p90_s=1.5, prefill_queue_p90_s=0.6, itl_p90_s=CALM_ITL))
    assert d["prefill"].direction == "up" and d["prefill"].desired == 2
    assert "TTFT p90 1.500 s" in d["prefill"].reason and "prefill queue p90 0.600 s" in d["prefill"].reason
    assert d["decode"].direction == "hold"


def test_ttft_threatened_with_little_queue_sends_decode_up():
    d = decide(Policy(config()), 0.0, 1, 1, obs(ttft_p90_s=1.5, prefill_queue_p90_s=0.01, itl_p90_s=CALM_ITL))
    assert d["decode"].direction == "up"
    assert "decode side is the bottleneck" in d["decode"].reason
    assert d["prefill"].direction == "hold"
    # no queue histogram at all (NaN) is little queue too
    d = decide(Policy(config()), 0.0, 1, 1, obs(ttft_p90_s=1.5, itl_p90_s=CALM_ITL))
    assert d["decode"].direction == "up" and d["prefill"].direction == "hold"


def test_a_threat_with_no_arrivals_holds_and_a_growth_at_no_load_does_not_block_the_scale_in():
    # the backlog of a burst, served after it: late first tokens and a slow decode, nothing new
    backlog = obs(arrivals_per_s=0.0, ttft_p90_s=40.0, itl_p90_s=HOT_ITL)
    d = decide(Policy(config()), 0.0, 1, 1, backlog, load(0.04))
    assert d["decode"].direction == d["prefill"].direction == "hold"
    assert d["decode"].reason.startswith("hold: nothing arrived in the interval") and "ITL" in d["decode"].reason
    # the model's answer is about the predicted load, not the interval's: it still scales out
    d = decide(Policy(config()), 0.0, 1, 1, backlog, load(0.04), needed={"prefill": 1, "decode": 2})
    assert d["decode"].direction == "up" and "the model needs 2" in d["decode"].reason
    # a role that grew when the recorded rate was 0 shrinks once comfortable (0 has no fraction)
    p = Policy(config(scale_in_intervals=1, cooldown_s=0.0))
    d = decide(p, 0.0, 1, 1, obs(itl_p90_s=HOT_ITL, arrivals_per_s=0.0), load(0.0), needed={"prefill": 1, "decode": 2})
    assert d["decode"].desired == 2
    p.changed("decode", 0.0)
    d = decide(p, 10.0, 1, 2, calm(0.0), load(0.0))
    assert d["decode"].direction == "down" and "no record of needing more" in d["decode"].reason


def test_hold_at_the_maximum():
    d = decide(Policy(config()), 0.0, 1, 3, obs(itl_p90_s=HOT_ITL))
    assert d["decode"].direction == "hold" and d["decode"].desired == 3
    assert d["decode"].reason.startswith("hold at the maximum 3") and "ITL" in d["decode"].reason


def test_hold_while_an_instance_of_the_role_is_starting():
    p = Policy(config())
    d = decide(p, 0.0, 1, 2, obs(itl_p90_s=HOT_ITL), starting={"decode": 1})
    assert d["decode"].direction == "hold" and "1 starting" in d["decode"].reason
    # one of the other role starting does not hold this one
    d = decide(p, 0.0, 2, 1, obs(itl_p90_s=HOT_ITL), starting={"prefill": 1})
    assert d["decode"].direction == "up"


def test_up_cooldown_after_a_change_of_that_role():
    p = Policy(config(up_cooldown_s=30.0))
    p.changed("decode", 100.0)
    d = decide(p, 110.0, 1, 2, obs(itl_p90_s=HOT_ITL, ttft_p90_s=1.5, prefill_queue_p90_s=0.6))
    assert d["decode"].direction == "hold" and "cooling down (10 s since the last change)" in d["decode"].reason
    # the other role's cooldown is its own
    assert d["prefill"].direction == "up"
    d = decide(p, 130.0, 1, 2, obs(itl_p90_s=HOT_ITL))
    assert d["decode"].direction == "up" and d["decode"].desired == 3


# scale-in


def grown_policy(**changes) -> Policy:
    """A policy whose decode grew from 1 to 2 at t=0 under 10 requests/s."""
    p = Policy(config(**changes))
    d = decide(p, 0.0, 1, 1, obs(itl_p90_s=HOT_ITL, arrivals_per_s=10.0), load(8.0))
    assert d["decode"].desired == 2
    p.changed("decode", 0.0)
    return p


def test_scale_in_waits_for_the_cooldown_and_the_comfortable_streak():
    p = grown_policy(scale_in_intervals=3, cooldown_s=60.0)
    for t in (10, 20, 30, 40, 50):  # comfortable from the first, but within the cooldown
        d = decide(p, float(t), 1, 2, calm(2.0))
        assert d["decode"].direction == "hold", t
    d = decide(p, 60.0, 1, 2, calm(2.0))
    assert d["decode"].direction == "down" and d["decode"].desired == 1
    assert "6 intervals under 0.5 x the SLO" in d["decode"].reason
    assert "vs 0.6 x the 10.00/s that made it grow past 1" in d["decode"].reason
    # prefill is at its minimum: never below it
    assert d["prefill"].direction == "hold"


def test_scale_in_needs_the_streak_after_the_cooldown():
    p = grown_policy(scale_in_intervals=3, cooldown_s=60.0)
    decide(p, 1000.0, 1, 2, obs(itl_p90_s=0.07))  # not comfortable (above the low water): no streak
    for t in (1010, 1020):
        assert decide(p, float(t), 1, 2, calm(2.0))["decode"].direction == "hold"
    assert decide(p, 1030.0, 1, 2, calm(2.0))["decode"].direction == "down"


def test_scale_in_needs_the_load_well_below_the_one_that_made_it_grow():
    p = grown_policy(scale_in_intervals=1, cooldown_s=0.0)
    # 7/s predicted is not below 0.6 x 10/s: comfortable, but no scale-in
    for t in range(10, 100, 10):
        assert decide(p, float(t), 1, 2, calm(7.0), load(7.0))["decode"].direction == "hold"
    d = decide(p, 100.0, 1, 2, calm(7.0), load(5.9))
    assert d["decode"].direction == "down"


def test_scale_in_is_reset_by_any_change():
    p = grown_policy(scale_in_intervals=2, cooldown_s=0.0)
    decide(p, 10.0, 1, 2, calm(1.0))
    p.changed("prefill", 15.0)  # the streak starts over
    assert decide(p, 20.0, 1, 2, calm(1.0))["decode"].direction == "hold"
    assert decide(p, 30.0, 1, 2, calm(1.0))["decode"].direction == "down"


def test_no_flapping_between_hot_and_comfortable_intervals():
    p = Policy(config(scale_in_intervals=2, cooldown_s=0.0, up_cooldown_s=0.0))
    current = {"prefill": 1, "decode": 1}
    seen = []
    for i in range(40):
        t = 10.0 * i
        o = obs(itl_p90_s=HOT_ITL, arrivals_per_s=5.0) if i % 2 == 0 else calm(0.1)
        for d in p.decide(t, dict(current), {}, o, load(o.arrivals_per_s)):
            seen.append(d.direction)
            if d.direction != "hold":
                current[d.role] = d.desired
                p.changed(d.role, t)
    assert "down" not in seen
    assert current == {"prefill": 1, "decode": 3}  # decode grew to its maximum and stayed


def test_never_below_the_minimum():
    p = Policy(config(min_instances={"prefill": 2, "decode": 2}, scale_in_intervals=1, cooldown_s=0.0))
    for t in range(0, 200, 10):
        d = decide(p, float(t), 2, 2, calm(0.0))
        assert d["prefill"].direction == d["decode"].direction == "hold"


# with the model


def test_the_models_answer_scales_out_up_to_the_maximum():
    p = Policy(config())
    d = decide(p, 0.0, 1, 1, calm(), needed={"prefill": 2, "decode": 5})
    assert (d["prefill"].desired, d["decode"].desired) == (2, 3)  # decode capped at its maximum
    assert "the model needs 5 for the predicted load" in d["decode"].reason
    assert "the model needs 2" in d["prefill"].reason
    # a threatened SLO still sends the role up when the model is content
    d = decide(Policy(config()), 0.0, 1, 1, obs(itl_p90_s=HOT_ITL), needed={"prefill": 1, "decode": 1})
    assert d["decode"].direction == "up" and "ITL" in d["decode"].reason


def test_the_model_decides_scale_in():
    p = Policy(config(scale_in_intervals=1, cooldown_s=0.0))
    # comfortable, but the model needs all 3: hold
    d = decide(p, 0.0, 3, 3, calm(), needed={"prefill": 3, "decode": 3})
    assert d["prefill"].direction == d["decode"].direction == "hold"
    d = decide(p, 10.0, 3, 3, calm(), needed={"prefill": 3, "decode": 1})
    assert d["decode"].direction == "down" and d["decode"].desired == 2  # one at a time
    assert "the model needs 1" in d["decode"].reason
    assert d["prefill"].direction == "hold"


def test_direction_and_nan_formatting():
    assert Decision("decode", 2, 2, "hold").direction == "hold"
    assert Decision("decode", 2, 3, "x").direction == "up"
    assert Decision("decode", 2, 1, "x").direction == "down"
    d = decide(Policy(config()), 0.0, 1, 1, obs(ttft_p90_s=1.5, itl_p90_s=math.nan))
    assert "queue (p90 n/a)" in d["decode"].reason
