"""Prometheus text read and written with prometheus_client (backend/cluster/prometheus_text.py):
a scrape's samples by name and labels, a line the parser cannot read skipped, and an exposition
whose label values are escaped so that it reads back as written."""

from __future__ import annotations

import math

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from backend.cluster.prometheus_text import exposition, samples


def test_samples_by_name_and_labels_skipping_what_cannot_be_read():
    text = (
        "# HELP x_total things\n# TYPE x_total counter\n"
        'x_total{model="a",version="1"} 3\n'
        'h_bucket{le="+Inf"} 7 1700000000000\n'
        "a malformed line\n"
        "plain 2.5\n"
    )
    assert samples(text) == {
        ("x_total", frozenset({("model", "a"), ("version", "1")})): 3.0,
        ("h_bucket", frozenset({("le", "+Inf")})): 7.0,
        ("plain", frozenset()): 2.5,
    }


def test_an_exposition_escapes_label_values_and_reads_back():
    odd = 'a "quoted"\\back\nslash'
    g = GaugeMetricFamily("g", "a gauge", labels=["figure"])
    g.add_metric([odd], math.nan)
    g.add_metric(["plain"], 2.0)
    c = CounterMetricFamily("c_total", "a counter", labels=["role"])
    c.add_metric(["decode"], 4.0)
    text = exposition([g, c])
    assert "# TYPE g gauge" in text and "# TYPE c_total counter" in text
    assert 'g{figure="a \\"quoted\\"\\\\back\\nslash"} NaN' in text
    got = samples(text)
    assert math.isnan(got[("g", frozenset({("figure", odd)}))])
    assert got[("g", frozenset({("figure", "plain")}))] == 2.0
    assert got[("c_total", frozenset({("role", "decode")}))] == 4.0
