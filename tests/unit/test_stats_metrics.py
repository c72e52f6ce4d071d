"""Typed stats and exported metrics match one to one: a stat without a metric, or a metric without
a stat, fails here (a misspelt name would otherwise vanish from the metrics)."""

from __future__ import annotations

import dataclasses

from backend.serving.stats import ROLE_STATS, DecodeStats, InstanceStats, RequestTotals, stat_names
from backend.triton.metrics import COUNTERS, GAUGES


def test_every_stat_has_a_metric_and_every_metric_a_stat():
    names = stat_names()
    metrics = set(GAUGES) | set(COUNTERS)
    assert names - metrics == set(), "stats without a metric"
    assert metrics - names == set(), "metrics without a stat"


def test_counters_are_totals_and_no_name_is_both():
    assert all(n.endswith("_total") for n in COUNTERS)  # Prometheus' convention for counters
    assert not set(GAUGES) & set(COUNTERS)
    for f in dataclasses.fields(RequestTotals):  # what the model bumps with add() are counters
        assert f.name in COUNTERS, f.name
    assert all(f.name in GAUGES or f.name in COUNTERS for cls in ROLE_STATS for f in dataclasses.fields(cls))


def test_update_refuses_an_unknown_stat():
    s = DecodeStats()
    s.update({"kv_writes_total": 3})
    assert s.as_dict()["kv_writes_total"] == 3
    try:
        s.update({"kv_write_total": 1})
    except AttributeError as e:
        assert "kv_write_total" in str(e)
    else:
        raise AssertionError("a misspelt stat was accepted")
    assert issubclass(DecodeStats, InstanceStats)
