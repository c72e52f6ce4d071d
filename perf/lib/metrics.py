"""Reading a server's Prometheus text (``/metrics``): every series, or one metric's values
filtered by labels. Used by the benchmarks and, through them, by the tests."""

from __future__ import annotations

import re

import requests

_LINE = re.compile(r"^(\w+)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def read_metrics(url: str) -> dict:
    """Parse Prometheus text into ``{(name, frozenset(labels)): value}``."""
    out = {}
    for line in requests.get(url, timeout=5).text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m:
            out[(m.group(1), frozenset(_LABEL.findall(m.group(2) or "")))] = float(m.group(3))
    return out


def metric_values(url: str, name: str, **labels) -> list[float]:
    """The values of every series of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return [v for (n, lab), v in read_metrics(url).items() if n == name and want <= set(lab)]


def metric_sum(url: str, name: str, **labels) -> float:
    """Sum of ``triton_disagg_<name>`` over the series whose labels include ``labels``."""
    return sum(metric_values(url, f"triton_disagg_{name}", **labels))
