"""The planner: the step-cost fit and the profile file, the simulator on cases computed by hand,
the goodput search, and ``triton-disagg plan`` end to end on a tiny profile."""

from __future__ import annotations

import json
import math
import shlex

import pytest

from backend.engine.step_profile import EngineProfile, StepCost, StepSample, ThreadProfile, features
from backend.planner.simulator import Deployment, InstanceSpec, simulate
from backend.planner.slo import SLO, attainment, goodput, measured_goodput
from backend.planner.stats import percentile
from backend.planner.workload import TraceRequest, load_trace, poisson, save_trace, scaled

# a step costs 10 ms + 2 ms per sequence + 1 ms per new token (no attention or batched term)
COEF = [0.010, 0.002, 0.001, 0.0, 0.0, 0.0]
GRID = [[(1, 64)] * b for b in (1, 2, 4, 8)] + [[(n, 0)] for n in (16, 64, 256)] + [[(1, 128)] * 2 + [(64, 0)]]


def exact_samples(coef=COEF) -> list[StepSample]:
    return [StepSample(c, sum(k * f for k, f in zip(coef, features(c)))) for c in GRID]


def tiny_profile(corun: float = 1.0, handoff: float = 0.005, threads=(1, 2)) -> EngineProfile:
    return EngineProfile(
        model="tiny",
        weights_dtype="float32",
        page_size=16,
        threads={t: ThreadProfile(t, exact_samples()) for t in threads},
        corun_slowdown=corun,
        handoff_s=handoff,
    )


def agg(budget=512, max_num_seqs=32, kv_tokens=16384) -> Deployment:
    return Deployment("agg", aggregated=(InstanceSpec(1, budget, max_num_seqs, kv_tokens),))


def disagg(budget=512) -> Deployment:
    return Deployment("disagg", prefill=(InstanceSpec(1, budget),), decode=(InstanceSpec(1, budget),))


def step(n_seqs: int, n_tokens: int) -> float:
    return COEF[0] + COEF[1] * n_seqs + COEF[2] * n_tokens


def test_fit_recovers_the_coefficients_and_drops_a_negative_one():
    cost = StepCost.fit(exact_samples())
    assert cost.coef == pytest.approx(COEF, abs=1e-9)
    assert max(cost.relative_errors(exact_samples())) < 1e-9
    assert ThreadProfile(1, exact_samples()).spread < 1e-9
    # data that a negative attention coefficient would fit best: the fit keeps every one >= 0
    noisy = [
        StepSample(s.chunks, s.seconds * (0.8 if len(s.chunks) == 1 and s.chunks[0][0] > 100 else 1.0))
        for s in exact_samples()
    ]
    assert min(StepCost.fit(noisy).coef) >= 0


def test_profile_file_round_trip_and_errors(tmp_path):
    prof = tiny_profile(corun=1.3)
    prof.served_overhead_s = {2: [0.001, 0.003]}
    path = tmp_path / "p.json"
    prof.save(path)
    back = EngineProfile.load(path)
    assert back.threads.keys() == prof.threads.keys()
    assert back.cost(2).coef == pytest.approx(COEF, abs=1e-9)
    assert (back.corun_slowdown, back.handoff_s, back.page_size) == (1.3, 0.005, 16)
    assert back.served_overhead_s == {2: [0.001, 0.003]}
    assert back.step_time(2, [(1, 5)]) == pytest.approx(0.013 + 0.001)
    assert back.scaled(2.0).served_overhead_s == {2: [0.0005, 0.0015]}
    assert back.scaled(2.0).cost(1).coef == pytest.approx([c / 2 for c in COEF], abs=1e-9)
    with pytest.raises(KeyError, match="no 4-thread"):
        back.cost(4)
    obj = json.loads(path.read_text())
    # a version 2 file (one attention term for prefill and decode) loads, refitted from its samples
    old = {**obj, "version": 2, "features": ["step", "sequence", "token", "attention_kpairs", "batched"]}
    assert EngineProfile.from_json(json.dumps(old)).cost(2).coef == pytest.approx(COEF, abs=1e-9)
    with pytest.raises(ValueError, match="unknown profile fields: \\['surprise'\\]"):
        EngineProfile.from_json(json.dumps({**obj, "surprise": 1}))
    with pytest.raises(ValueError, match="version"):
        EngineProfile.from_json(json.dumps({**obj, "version": 99}))


def test_one_request_aggregated():
    (res,) = simulate(agg(), tiny_profile(), [TraceRequest(0.0, 100, 3)])
    first = step(1, 100)
    assert res.token_times == pytest.approx([first, first + step(1, 1), first + 2 * step(1, 1)])
    assert res.ttft == pytest.approx(0.112)
    assert res.gaps == pytest.approx([0.013, 0.013])


def test_served_overheads_delay_the_first_token_and_stretch_every_step():
    prof = tiny_profile()
    prof.request_overhead_s, prof.served_overhead_s = 0.05, {1: [0.002, 0.004]}
    (res,) = simulate(agg(), prof, [TraceRequest(0.0, 100, 2)])
    # the prefill step is batched (+4 ms), the decode step is a single token (+2 ms)
    assert res.token_times == pytest.approx([0.05 + 0.116, 0.05 + 0.116 + 0.015])


def test_one_request_chunked_prefill():
    (res,) = simulate(agg(budget=64), tiny_profile(), [TraceRequest(1.0, 100, 1)])
    assert res.ttft == pytest.approx(step(1, 64) + step(1, 36))
    assert res.completed


def test_one_request_disaggregated_runs_all_but_the_last_prompt_token_remotely():
    (res,) = simulate(disagg(), tiny_profile(handoff=0.005), [TraceRequest(0.0, 100, 3)])
    first = step(1, 99) + 0.005 + step(1, 1)
    assert res.token_times == pytest.approx([first, first + 0.013, first + 0.026])


def test_a_short_prompt_is_prefilled_on_the_decode_instance():
    (res,) = simulate(disagg(), tiny_profile(handoff=0.5), [TraceRequest(0.0, 20, 1)])
    assert res.ttft == pytest.approx(step(1, 20))


def test_fixed_rate_stream_with_known_service_times():
    # one request a second, each served in 0.112 + 2 * 0.013 s: no two overlap
    trace = [TraceRequest(float(i), 100, 3) for i in range(10)]
    results = simulate(agg(), tiny_profile(), trace)
    assert [r.ttft for r in results] == pytest.approx([0.112] * 10)
    assert attainment(results, SLO(0.112 + 1e-9, 0.013 + 1e-9)) == 1.0
    assert attainment(results, SLO(0.11, 1.0)) == 0.0


def test_saturated_queue_serves_in_arrival_order():
    # one sequence at a time; five requests at t=0: request k waits for k whole services
    service = step(1, 100) + 2 * step(1, 1)
    results = simulate(agg(max_num_seqs=1), tiny_profile(), [TraceRequest(0.0, 100, 3) for _ in range(5)])
    assert [r.ttft for r in results] == pytest.approx([k * service + step(1, 100) for k in range(5)])
    # the same when the pool holds one request's pages (128 tokens = 8 pages; each needs 7)
    results = simulate(agg(kv_tokens=128), tiny_profile(), [TraceRequest(0.0, 100, 3) for _ in range(5)])
    assert [r.ttft for r in results] == pytest.approx([k * service + step(1, 100) for k in range(5)])


def test_corun_slowdown_on_a_shared_machine():
    # A's decode steps start while the prefill instance computes B's prompt: they last twice as long
    prof = tiny_profile(corun=2.0, handoff=0.005)
    a, b = simulate(disagg(), prof, [TraceRequest(0.0, 100, 3), TraceRequest(0.05, 100, 1)])
    pre = step(1, 99)  # 0.111; B's prefill runs from 0.111 to 0.222 (the decode was idle at its start)
    ready = pre + 0.005
    assert a.token_times == pytest.approx([ready + 0.026, ready + 0.052, ready + 0.078])
    # on separate machines there is no slowdown
    apart = Deployment("apart", prefill=(InstanceSpec(1, 512, machine=0),), decode=(InstanceSpec(1, 512, machine=1),))
    a2, _ = simulate(apart, prof, [TraceRequest(0.0, 100, 3), TraceRequest(0.05, 100, 1)])
    assert a2.token_times == pytest.approx([ready + 0.013, ready + 0.026, ready + 0.039])


def test_step_variation_follows_the_profiles_spread():
    scattered = [StepSample(s.chunks, s.seconds * f) for s in exact_samples() for f in (0.8, 1.2)]
    prof = EngineProfile("tiny", "float32", 16, {1: ThreadProfile(1, scattered)})
    assert 0.15 < prof.threads[1].spread < 0.25
    trace = [TraceRequest(float(i), 100, 20) for i in range(5)]
    gaps = [g for r in simulate(agg(), prof, trace) for g in r.gaps]
    assert min(gaps) < 0.9 * max(gaps)  # steps vary
    assert [r.token_times for r in simulate(agg(), prof, trace, seed=3)] == [
        r.token_times for r in simulate(agg(), prof, trace, seed=3)
    ]  # and the same seed gives the same run


def test_goodput_search_and_percentile():
    assert goodput(lambda r: 1.0 if r <= 3.3 else 0.0, 0.1) == pytest.approx(3.3, rel=0.03)
    assert goodput(lambda r: 1.0 if r <= 3.3 else 0.0, 0.1) <= 3.3
    assert goodput(lambda r: 1.0 if r <= 0.02 else 0.0, 1.0) == pytest.approx(0.02, rel=0.03)
    assert goodput(lambda r: 0.0, 1.0) == 0.0
    assert percentile([1, 2, 3, 4], 50) == 2.5 and math.isnan(percentile([], 90))
    # measured points: every rate up to the answer attains the goal
    assert measured_goodput({0.5: 1.0, 1.0: 0.95, 2.0: 0.5, 4.0: 0.95}) == 1.0
    assert measured_goodput({0.5: 0.2, 1.0: 1.0}) == 0.0


def test_a_one_token_answer_has_no_gaps_and_meets_the_itl_bound():
    """The percentile of no gaps is NaN (no figure), and the SLO does not ask it of such an answer."""
    slo = SLO(ttft_s=1.0, itl_p90_s=0.1)
    (one,) = simulate(agg(), tiny_profile(), [TraceRequest(0.0, 20, 1)])
    assert one.completed and one.gaps == [] and slo.met(one)
    assert slo.attained(True, 0.5, []) and not slo.attained(True, 0.5, [0.2, 0.3]) and not slo.attained(False, 0.5, [])


def test_goodput_of_a_simulated_deployment_falls_between_service_bounds():
    # the aggregated instance serves ~1/0.138 req/s one at a time; with batching it does more,
    # and at the unloaded TTFT SLO the rate must stay low enough that requests rarely overlap
    prof = tiny_profile()

    def attained(rate: float) -> float:
        return attainment(simulate(agg(), prof, poisson(rate, 200, (100, 100), (3, 3), seed=1)), SLO(1.0, 1.0))

    g = goodput(attained, 1.0)
    assert 7.0 < g < 200.0
    assert attained(g) >= 0.9


def test_trace_file_round_trip_and_errors(tmp_path):
    trace = poisson(2.0, 5, (10, 20), (3, 4), seed=3)
    save_trace(tmp_path / "t.jsonl", trace)
    assert load_trace(tmp_path / "t.jsonl") == trace
    assert len(scaled(trace, 4.0)) == 5 and scaled(trace, 4.0)[-1].arrival_s == pytest.approx(5 / 4.0)
    (tmp_path / "bad.jsonl").write_text('{"arrival_s": 0, "prompt_tokens": 3, "output": 2}\n')
    with pytest.raises(ValueError, match="unknown fields \\['output'\\], missing fields \\['output_tokens'\\]"):
        load_trace(tmp_path / "bad.jsonl")


def test_plan_cli_end_to_end_on_a_tiny_profile(tmp_path, capsys):
    from backend.cli import main

    tiny_profile(corun=1.2).save(tmp_path / "p.json")
    rc = main(
        [
            "plan",
            "--profile",
            str(tmp_path / "p.json"),
            "--cores",
            "2",
            "--budgets",
            "64,512",
            "--ttft-slo",
            "0.5",
            "--itl-slo",
            "0.03",
            "--prompt-tokens",
            "100",
            "200",
            "--output-tokens",
            "4",
            "8",
            "--requests",
            "80",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    names = ["aggregated 2 threads, budget 64", "disagg 1P:1D threads, budget 64", "aggregated 2 threads, budget 512"]
    for name in names:
        assert f"| {name} |" in out
    assert "recommended: " in out
    command = out.strip().splitlines()[-1]
    assert command.startswith("triton-disagg serve ")
    # the printed command is one the CLI accepts
    import argparse

    from backend.cli import _add_server_args

    p = argparse.ArgumentParser()
    _add_server_args(p)
    parsed = p.parse_args(shlex.split(command)[2:])
    assert parsed.mode in ("aggregated", "disagg")
