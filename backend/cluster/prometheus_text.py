"""Prometheus text (exposition format 0.0.4), read and written with ``prometheus_client``.

- ``samples``: every sample of a scrape as ``{(name, frozenset(labels)): value}``, read line by
  line by the library's parser so that a line it cannot read is skipped, not the whole scrape;
  ``read_metrics`` / ``metric_values`` / ``metric_sum`` read them from a ``/metrics`` URL.
- ``exposition``: the text of metric families (``prometheus_client.core.*MetricFamily``) through
  the library's writer (label values escaped, NaN and infinities spelt as Prometheus reads them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import requests
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """The samples of Prometheus text; comments, blank and unreadable lines left out."""
    out: Samples = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        try:
            families = list(text_string_to_metric_families(line + "\n"))
        except ValueError:
            continue
        for family in families:
            for s in family.samples:
                out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out


def read_metrics(url: str, timeout_s: float = 5.0) -> Samples:
    """The samples a server's ``/metrics`` URL serves now."""
    return samples(requests.get(url, timeout=timeout_s).text)


def metric_values(url: str, name: str, **labels) -> list[float]:
    """The values of every series of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return [v for (n, lab), v in read_metrics(url).items() if n == name and want <= set(lab)]


def metric_sum(url: str, name: str, **labels) -> float:
    """Sum of ``triton_disagg_<name>`` over the series whose labels include ``labels``."""
    return sum(metric_values(url, f"triton_disagg_{name}", **labels))


class _Families:
    """A collector that gives the families it was made with."""

    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def exposition(families: Iterable[Metric]) -> str:
    """The Prometheus text of ``families``, in their order."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode()
