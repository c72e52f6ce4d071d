"""Time to first token of one long prompt: aggregated vs disaggregated, and how much of the
KV transfer overlaps the prefill compute (layer-wise streaming vs sending after the prefill).

Runs four deployments one after the other on this machine (see ``perf/lib/servers.py``):
aggregated with every core, aggregated on only the prefill instance's cores (the same compute
as the disaggregated prefill, which isolates what disaggregation itself adds), disaggregated
with layer-wise streaming, disaggregated sending all KV after the prefill
(``stream_layers=false``). Requests are sequential (low load). For the disaggregated
runs the prefill instance's counters give the compute time and the *transfer tail* (from the
last chunk computed to every write done): with layer-wise streaming the tail is what did
not overlap with compute. Writes JSON to the results folder (``perf/results/``).

    python -m perf.bench_ttft [--prompt-tokens 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from backend.client import stream_generate
from backend.cluster.prometheus_text import metric_values
from backend.launch.deployment import core_split
from backend.planner.stats import median
from perf.lib import loadgen, servers
from perf.lib.results import results_dir


def long_prompt(tokenizer, n_tokens: int) -> str:
    words = " ".join(f"item{i} costs {i % 97} dollars;" for i in range(n_tokens))
    ids = tokenizer.encode(words, add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids)


def counters(url: str, model: str) -> dict:
    names = [
        "prefill_compute_seconds_total",
        "kv_transfer_tail_seconds_total",
        "prefills_total",
        "kv_writes_total",
        "kv_transfer_bytes_total",
    ]
    return {n: sum(metric_values(url, f"triton_disagg_{n}", model=model)) for n in names}


def measure(server, prompt: str, repeats: int, disagg: bool) -> dict:
    stream_generate(server.grpc_url, prompt, 2, ignore_eos=True)  # warm-up
    time.sleep(0.6)
    before = counters(server.metrics_url, "prefill_0") if disagg else None
    ttfts = []
    for _ in range(repeats):
        r = stream_generate(server.grpc_url, prompt, 4, ignore_eos=True)
        assert r.error is None, r.error
        ttfts.append(r.ttft)
    out = {"ttft_s": ttfts, "ttft_p50_s": median(ttfts), "n_prompt_tokens": None}
    if disagg:
        time.sleep(0.6)
        after = counters(server.metrics_url, "prefill_0")
        n = after["prefills_total"] - before["prefills_total"]
        d = {k: (after[k] - before[k]) / max(n, 1) for k in after}
        out.update(
            {
                "prefill_compute_s": d["prefill_compute_seconds_total"],
                "transfer_tail_s": d["kv_transfer_tail_seconds_total"],
                "writes_per_request": d["kv_writes_total"],
                "bytes_per_request": d["kv_transfer_bytes_total"],
            }
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    tok = loadgen.load_tokenizer()
    prompt = long_prompt(tok, args.prompt_tokens)
    n_tokens = len(tok.encode(prompt, add_special_tokens=False))
    # Every request repeats one prompt: without this the prefix cache would serve it after the
    # warm-up, and the disaggregated runs would send no KV at all.
    common = {
        "kv_cache_tokens": "8192",
        "max_num_batched_tokens": "256",
        "max_tokens_limit": "64",
        "enable_prefix_caching": "false",
    }
    runs = {}
    pre_cores, _, n_pre, _ = core_split()
    same_compute = {"llm": {"cpu_affinity": pre_cores, "num_threads": str(n_pre)}}
    for name, mode, per_model in (
        ("aggregated", "aggregated", {}),
        ("aggregated_prefill_cores", "aggregated", same_compute),
        ("disagg_layerwise", "disagg", {"prefill": {"stream_layers": "true"}}),
        ("disagg_after_prefill", "disagg", {"prefill": {"stream_layers": "false"}}),
    ):
        with servers.started(mode, overrides=common, per_model=per_model) as server:
            runs[name] = measure(server, prompt, args.repeats, mode == "disagg")
            runs[name]["n_prompt_tokens"] = n_tokens
        print(name, json.dumps(runs[name]), flush=True)
    agg = runs["aggregated"]["ttft_p50_s"]
    agg_same = runs["aggregated_prefill_cores"]["ttft_p50_s"]
    lw, after = runs["disagg_layerwise"], runs["disagg_after_prefill"]
    overlap = 1 - lw["transfer_tail_s"] / after["transfer_tail_s"] if after["transfer_tail_s"] > 0 else float("nan")
    print(f"\n## TTFT, {n_tokens}-token prompt ({platform.node()}, {args.repeats} runs each, p50)\n")
    print(
        "| deployment | TTFT p50 (s) | vs aggregated | vs aggregated on the prefill's cores | prefill compute (s) "
        "| transfer tail (s) | writes/request | MiB/request |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        extra = (
            (
                f"{r['prefill_compute_s']:.3f} | {r['transfer_tail_s']:.4f} | {r['writes_per_request']:.0f} | "
                f"{r['bytes_per_request'] / 2**20:.1f}"
            )
            if "prefill_compute_s" in r
            else "- | - | - | -"
        )
        print(
            f"| {name} | {r['ttft_p50_s']:.3f} | {r['ttft_p50_s'] / agg:.2f}x | {r['ttft_p50_s'] / agg_same:.2f}x "
            f"| {extra} |"
        )
    print(
        f"\nLayer-wise streaming hid {overlap:.1%} of the post-prefill transfer time "
        f"(tail {lw['transfer_tail_s'] * 1e3:.1f} ms vs {after['transfer_tail_s'] * 1e3:.1f} ms "
        "when sending after the prefill)."
    )
    out = results_dir() / f"bench_ttft_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.write_text(json.dumps({"runs": runs, "overlap_fraction": overlap}, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
