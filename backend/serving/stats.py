"""Typed statistics of a model instance, one dataclass per worker role: each field is one exported
metric (``triton_disagg_<field>``, a gauge or a counter as ``backend/triton/metrics.py`` lists and
describes it). A unit test checks that every field has a metric and every metric a field, so a
misspelt name fails there instead of vanishing."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# stat field -> the engine's pool_stats() key (``LLMEngine.pool_stats``: the KV tiers' figures)
TIER_STATS = {
    "kv_tier_host_blocks": "tier_host_blocks",
    "kv_tier_host_hit_blocks_total": "tier_host_hit_blocks",
    "kv_tier_spilled_blocks_total": "tier_spilled_blocks",
    "kv_tier_disk_blocks": "tier_disk_blocks",
    "kv_tier_disk_bytes": "tier_disk_bytes",
    "kv_tier_disk_hit_blocks_total": "tier_disk_hit_blocks",
    "kv_tier_disk_writes_total": "tier_disk_writes",
    "kv_tier_disk_dropped_total": "tier_disk_dropped",
    "kv_tier_disk_corrupt_total": "tier_disk_corrupt",
    "kv_tier_disk_read_errors_total": "tier_disk_read_errors",
    "kv_tier_load_failures_total": "tier_load_failures",
    "kv_tier_load_seconds_total": "tier_load_seconds",
    "kv_tier_host_load_seconds_total": "tier_host_load_seconds",
    "kv_tier_disk_load_seconds_total": "tier_disk_load_seconds",
    "kv_tier_shared_load_seconds_total": "tier_shared_load_seconds",
    "kv_tier_host_miss_blocks_total": "tier_host_miss_blocks",
    "kv_tier_disk_miss_blocks_total": "tier_disk_miss_blocks",
    "kv_tier_shared_miss_blocks_total": "tier_shared_miss_blocks",
    "kv_tier_host_evicted_blocks_total": "tier_host_evicted_blocks",
    "kv_tier_disk_evicted_blocks_total": "tier_disk_evicted",
    "kv_tier_block_bytes": "tier_block_bytes",
    "kv_tier_shared_up": "tier_shared_up",
    "kv_tier_shared_hit_blocks_total": "tier_shared_hits",
    "kv_tier_shared_writes_total": "tier_shared_writes",
    "kv_tier_shared_dropped_total": "tier_shared_dropped",
    "kv_tier_shared_errors_total": "tier_shared_errors",
    "kv_tier_shared_corrupt_total": "tier_shared_corrupt",
}


@dataclass
class InstanceStats:
    """What every role exports: its KV pool and prefix cache, and its requests in flight (set by
    the model from its admission)."""

    kv_pages_total: int = 0
    kv_pages_free: int = 0
    kv_pages_used: int = 0
    prefix_cache_cached_pages: int = 0
    prefix_cache_query_tokens_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    prefix_cache_evictions_total: int = 0
    kv_tier_hit_tokens_total: int = 0
    kv_tier_host_blocks: int = 0
    kv_tier_host_hit_blocks_total: int = 0
    kv_tier_spilled_blocks_total: int = 0
    kv_tier_disk_blocks: int = 0
    kv_tier_disk_bytes: int = 0
    kv_tier_disk_hit_blocks_total: int = 0
    kv_tier_disk_writes_total: int = 0
    kv_tier_disk_dropped_total: int = 0
    kv_tier_disk_corrupt_total: int = 0
    kv_tier_disk_read_errors_total: int = 0
    kv_tier_load_failures_total: int = 0
    kv_tier_load_seconds_total: float = 0.0
    kv_tier_host_load_seconds_total: float = 0.0
    kv_tier_disk_load_seconds_total: float = 0.0
    kv_tier_shared_load_seconds_total: float = 0.0
    kv_tier_host_miss_blocks_total: int = 0
    kv_tier_disk_miss_blocks_total: int = 0
    kv_tier_shared_miss_blocks_total: int = 0
    kv_tier_host_evicted_blocks_total: int = 0
    kv_tier_disk_evicted_blocks_total: int = 0
    kv_tier_block_bytes: int = 0
    kv_tier_shared_up: int = 0
    kv_tier_shared_hit_blocks_total: int = 0
    kv_tier_shared_writes_total: int = 0
    kv_tier_shared_dropped_total: int = 0
    kv_tier_shared_errors_total: int = 0
    kv_tier_shared_corrupt_total: int = 0
    requests_active: int = 0
    trace_spans_dropped_total: int = 0  # set by whoever holds the instance's tracer

    def set_pool(self, pool: dict) -> None:
        """From ``PageAllocator.stats()``."""
        self.kv_pages_total = pool["total"]
        self.kv_pages_free = pool["free"]
        self.kv_pages_used = pool["used"]
        self.prefix_cache_cached_pages = pool["cached"]
        self.prefix_cache_query_tokens_total = pool["prefix_query_tokens"]
        self.prefix_cache_hit_tokens_total = pool["prefix_hit_tokens"]
        self.prefix_cache_evictions_total = pool["prefix_evictions"]
        self.kv_tier_hit_tokens_total = pool["prefix_tier_hit_tokens"]
        for name, key in TIER_STATS.items():  # absent where the instance has no tiers
            setattr(self, name, pool.get(key, 0))

    def update(self, values: dict) -> None:
        """Take a connector's totals; a key that is not a field is a bug (AttributeError)."""
        for k, v in values.items():
            if not hasattr(self, k):
                raise AttributeError(f"{type(self).__name__} has no stat {k!r}")
            setattr(self, k, v)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass
class AggregatedStats(InstanceStats):
    pass


@dataclass
class DecodeStats(InstanceStats):
    requests_waiting_kv: int = 0
    prefill_endpoints_connected: int = 0
    prefill_local_total: int = 0
    prefill_remote_total: int = 0
    kv_loads_recomputed_total: int = 0
    kv_transfer_seconds_total: float = 0.0
    kv_transfer_bytes_total: int = 0
    kv_writes_total: int = 0


@dataclass
class PrefillStats(InstanceStats):
    prefill_queue_depth: int = 0
    prefills_total: int = 0
    prefill_compute_seconds_total: float = 0.0
    kv_transfer_tail_seconds_total: float = 0.0
    kv_transfer_bytes_total: int = 0
    kv_writes_total: int = 0
    kv_posts_deferred_total: int = 0


@dataclass
class RequestTotals:
    """Counters the model bumps as each request ends (``InstanceMetrics.add``)."""

    requests_total: int = 0
    requests_failed_total: int = 0
    output_tokens_total: int = 0
    ttft_seconds_total: float = 0.0


ROLE_STATS: tuple[type[InstanceStats], ...] = (AggregatedStats, DecodeStats, PrefillStats)


def stat_names() -> set[str]:
    """Every name a worker or model reports: the metrics must be exactly these."""
    names = {f.name for cls in ROLE_STATS for f in dataclasses.fields(cls)}
    return names | {f.name for f in dataclasses.fields(RequestTotals)}
