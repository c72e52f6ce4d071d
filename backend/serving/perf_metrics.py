"""One request's own figures (``return_perf_metrics``): what its last response carries as the
``perf_metrics`` output, a JSON object (TensorRT-LLM's backend returns such figures as tensors).

The instance that serves the request fills what it sees (times from the request's arrival
there, in seconds): ``queue_s`` (waiting for KV pages and a seat; decode instance), ``ttft_s``,
``e2e_s``; where its prompt's KV came from: ``prefill`` (``remote``: a prefill instance,
``local``: computed here), ``cached_tokens`` (its prefix cache and KV tiers), and for a remote
prefill ``prefill_queue_s`` (asked to the prefill instance starting it), ``kv_transfer_s`` (the
prefill instance starting it to the last KV write landing: its compute overlapped with the
layer-by-layer transfer), ``kv_wait_s`` (the two together), ``kv_pages``, ``kv_bytes`` and
``kv_load_failures`` (loads computed again); the token counts. The front model adds what it
sees across attempts: ``migrations``, ``attempts`` and its own ``front_ttft_s``. A figure that
does not apply is absent.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


@dataclass
class RequestFigures:
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    queue_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prefill: str | None = None
    prefill_queue_s: float | None = None
    kv_transfer_s: float | None = None
    kv_wait_s: float | None = None
    kv_pages: int | None = None
    kv_bytes: int | None = None
    kv_load_failures: int | None = None

    def to_json(self) -> str:
        return json.dumps(_rounded({k: v for k, v in dataclasses.asdict(self).items() if v is not None}))


def with_route(figures_json: str | bytes, **route: float | int) -> str:
    """``figures_json`` (an instance's) with the front's figures added."""
    try:
        figures = json.loads(figures_json)
    except (ValueError, TypeError):
        figures = {}
    if not isinstance(figures, dict):
        figures = {}
    figures.update(_rounded(route))
    return json.dumps(figures)


def _rounded(figures: dict) -> dict:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in figures.items()}
