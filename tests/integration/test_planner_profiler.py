"""The planner's profiler on the real engine (a tiny model): it measures steps of known
composition, and the co-run slowdown against a second process, and writes a profile that loads.
(The fit, the simulator and the CLI are unit-tested.)"""

from __future__ import annotations

from backend.engine.step_profile import EngineProfile


def test_profiler_measures_a_loadable_profile_on_the_real_engine(tmp_path):
    from engine_helpers import build_tiny_llama

    from backend.planner.profiler import SMALL_GRID, profile_engine

    model = build_tiny_llama(tmp_path / "tiny")
    prof = profile_engine(str(model), [1], grid=SMALL_GRID, corun=True)
    assert set(prof.threads) == {1}
    samples = prof.threads[1].samples
    # decode points x steps, whole prefills, mixes, chunked prefills at rising contexts
    assert len(samples) == 2 * 2 * 2 + 2 + 1 + 3
    assert {c for s in samples for c in s.chunks} >= {(16, 0), (16, 16), (16, 32), (1, 64), (64, 0)}
    assert all(s.seconds > 0 for s in samples)
    assert all(c >= 0 for c in prof.cost(1).coef) and prof.cost(1).step_time([(1, 16)]) > 0
    assert prof.corun_slowdown > 0
    prof.save(tmp_path / "p.json")
    assert EngineProfile.load(tmp_path / "p.json").threads[1].samples == samples
