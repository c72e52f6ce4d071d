"""Benchmark: multi-turn conversations with a shared system prompt, prefix caching off vs on,
aggregated and disaggregated, side by side in one run (each deployment started here with
``perf/lib/servers.py``; ``enable_prefix_caching`` false / true).

Workload (the KV-reuse issue's, scaled by the options): ``--conversations`` conversations run
concurrently, each ``--turns`` turns; every prompt starts with the same ~``--system-tokens``
system prompt; each turn adds ~``--user-tokens`` user tokens to the whole history (the
assistant's previous answers included) and asks for ``--output-tokens`` tokens; a think time
of ``--think-s`` seconds between turns. Reports TTFT p50 of turn 1 and of turns 2.., completed
requests/s, and (disaggregated) KV bytes sent per request. Writes ``multiturn.{json,md}``
(``multiturn-routing.{json,md}`` with ``--routing``) to the results folder (``perf/results/``).

    python -m perf.bench_multiturn [--conversations 8] [--turns 6] [--output-tokens 64]

With ``--routing``: KV-aware routing against least-loaded routing instead (disaggregated, 1
prefill + 2 decode instances, caching on; ``kv_routing_weight`` 1 vs 0 on the front and the
decode instances), with the decode instances' own prefix-cache hits.

With ``--tiers``: the KV tiers below the pool against none (caching on in both), each instance's
pool cut to ``--pool-tokens`` (default 3,072: the conversations' KV is then about 4x it) so that
turns are evicted between visits; tiers on: a host tier of ``--host-tokens``, the disk tier (its
own folder per run, admission after one hit) and, disaggregated, the shared tier (the private
Redis the launcher starts); off: ``kv_host_tokens`` 0, ``kv_disk_bytes`` 0, no ``kv_store_url``;
both: decode instances wait for free pages up to ``PAGE_WAIT_S`` (no turn refused as overloaded).
``--think-s`` may be a comma list: each think time is measured (short ones keep the deployments
busy, long ones leave them idle between turns).
Also checks that every turn's output is the same text with and without tiers. Writes ``multiturn-tiers.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import threading
import time

from backend.client import stream_generate
from backend.cluster.prometheus_text import metric_sum
from backend.planner.stats import median
from perf.lib import loadgen, servers
from perf.lib.progress import Progress
from perf.lib.results import results_dir

PAGE_WAIT_S = 300  # --tiers: how long a decode instance waits for free pages (page_wait_timeout_s)


def _words(tokenizer, n_tokens: int, rng: random.Random) -> str:
    vocab = ["river", "mountain", "policy", "engine", "garden", "signal", "market", "theory", "orbit", "canvas"]
    text = ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < n_tokens:
        text += " " + " ".join(rng.choice(vocab) + str(rng.randint(0, 99)) for _ in range(8))
    return text.strip()


def run(
    mode: str,
    caching: bool,
    args,
    tokenizer,
    routing_weight: float | None = None,
    tiers: bool | None = None,
    think_s: float | None = None,
) -> dict:
    """One deployment under the workload (``think_s``: between turns, else ``--think-s``'s first).
    ``routing_weight`` (disaggregated, 2 decode instances): the front's and the decode instances'
    ``kv_routing_weight`` (0: least loaded). ``tiers`` (not None): pools of ``--pool-tokens``,
    with the host and disk tiers or without any."""
    think = args.think_s[0] if think_s is None else think_s
    overrides = {"enable_prefix_caching": str(caching).lower(), "local_prefill_max_tokens": "0"}
    render: dict = {}
    tag = f"{mode}-{caching}"
    if tiers is not None:
        tag += f"-tiers{tiers}-think{think:g}"
        disk = results_dir() / f"multiturn-{tag}" / "kv"
        shutil.rmtree(disk, ignore_errors=True)  # no blocks of an earlier run: each run starts cold
        overrides["kv_cache_tokens"] = str(args.pool_tokens)
        # a turn waits for pages as long as it takes (the default 10 s refuses some turns of the
        # disaggregated deployment without tiers as overloaded, which would end their conversations)
        overrides["page_wait_timeout_s"] = str(PAGE_WAIT_S)
        overrides.update(
            {"kv_host_tokens": str(args.host_tokens), "kv_disk_path": str(disk), "kv_disk_admit_hits": "1"}
            if tiers
            else {"kv_host_tokens": "0", "kv_disk_bytes": "0", "kv_store_url": ""}
        )
    if routing_weight is not None:
        overrides["kv_routing_weight"] = str(routing_weight)
        render = {"decode_instances": 2, "per_model": {"front": {"kv_routing_weight": str(routing_weight)}}}
        tag += f"-routing{routing_weight}"
    with servers.started(mode, overrides=overrides, log_dir=results_dir() / f"multiturn-{tag}", **render) as server:
        rng = random.Random(7)
        system = "System: " + _words(tokenizer, args.system_tokens, rng)
        users = [
            [_words(tokenizer, args.user_tokens, rng) for _ in range(args.turns)] for _ in range(args.conversations)
        ]
        records, errors, texts = [], [], {}
        stream_generate(server.grpc_url, "warm up", 4, ignore_eos=True)
        bytes0 = metric_sum(server.metrics_url, "kv_transfer_bytes_total") if mode == "disagg" else 0.0

        progress = Progress(args.conversations * args.turns, tag, unit="req")

        def conversation(c: int) -> None:
            history = system
            time.sleep(c * think / max(1, args.conversations))  # staggered starts
            for t in range(args.turns):
                history += f"\nUser: {users[c][t]}\nAssistant:"
                res = stream_generate(
                    server.grpc_url, history, args.output_tokens, ignore_eos=True, temperature=0.0, timeout_s=600
                )
                if res.error:
                    errors.append(res.error)
                    return
                records.append((t, res.ttft, len(tokenizer.encode(history, add_special_tokens=False))))
                texts[f"{c}/{t}"] = res.text
                progress.update()
                history += res.text
                time.sleep(think)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=conversation, args=(c,)) for c in range(args.conversations)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        wall = time.perf_counter() - t0
        progress.close()
        time.sleep(0.6)  # metrics refresh
        sent = (metric_sum(server.metrics_url, "kv_transfer_bytes_total") - bytes0) if mode == "disagg" else 0.0
        hits = metric_sum(server.metrics_url, "prefix_cache_hit_tokens_total")
        tier_hits = metric_sum(server.metrics_url, "kv_tier_hit_tokens_total")
        decode_hits = sum(
            metric_sum(server.metrics_url, "prefix_cache_hit_tokens_total", model=f"decode_{i}") for i in range(2)
        )
        # a disaggregated deployment counts bytes on both sides (sent and received): halve it
        n = len(records)
        return {
            "requests": n,
            "errors": errors[:3],
            "ttft_turn1_p50_s": median(r[1] for r in records if r[0] == 0),
            "ttft_later_p50_s": median(r[1] for r in records if r[0] > 0),
            "prompt_tokens_mean": statistics.mean(r[2] for r in records),
            "requests_per_s": n / wall,
            "kv_bytes_per_request": sent / 2 / n if n and mode == "disagg" else None,
            "prefix_hit_tokens": hits,
            "decode_hit_tokens": decode_hits if mode == "disagg" else None,
            "tier_hit_tokens": tier_hits,
            "outputs": texts,
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="aggregated,disagg")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=800)
    p.add_argument("--user-tokens", type=int, default=60)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument(
        "--think-s",
        type=_seconds,
        default=[1.0],
        help="seconds between a conversation's turns; with --tiers a comma list measures each (a sweep)",
    )
    p.add_argument(
        "--tiers",
        action="store_true",
        help="instead: the KV tiers below the pool vs none (caching on, pools of --pool-tokens)",
    )
    p.add_argument("--pool-tokens", type=int, default=3072, help="--tiers: each instance's KV pool")
    p.add_argument("--host-tokens", type=int, default=16384, help="--tiers: each instance's host tier")
    p.add_argument(
        "--routing",
        action="store_true",
        help="instead: KV-aware routing vs least loaded (disaggregated, 1 prefill + 2 decode instances, caching on)",
    )
    args = p.parse_args(argv)
    if len(args.think_s) > 1 and not args.tiers:
        p.error("--think-s takes one value without --tiers")
    tokenizer = loadgen.load_tokenizer()
    if args.routing:
        return _routing(args, tokenizer)
    if args.tiers:
        return _tiers(args, tokenizer)
    results = {}
    for mode in args.modes.split(","):
        for caching in (False, True):
            results[f"{mode}, caching {'on' if caching else 'off'}"] = run(mode, caching, args, tokenizer)
    rows = [
        "| deployment | TTFT p50 turn 1 (ms) | TTFT p50 turns 2+ (ms) | requests/s | KV bytes/request | hit tokens |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        kv = f"{r['kv_bytes_per_request'] / 2**20:.1f} MiB" if r["kv_bytes_per_request"] is not None else "-"
        rows.append(
            f"| {name} | {1e3 * r['ttft_turn1_p50_s']:.0f} | {1e3 * r['ttft_later_p50_s']:.0f} "
            f"| {r['requests_per_s']:.3f} | {kv} | {r['prefix_hit_tokens']:.0f} |"
        )
    for mode in args.modes.split(","):
        off, on = results[f"{mode}, caching off"], results[f"{mode}, caching on"]
        line = f"{mode}: TTFT turns 2+ on/off {on['ttft_later_p50_s'] / off['ttft_later_p50_s']:.2f}x, "
        line += f"requests/s on/off {on['requests_per_s'] / off['requests_per_s']:.2f}x"
        if on["kv_bytes_per_request"]:
            line += f", KV bytes/request on/off {on['kv_bytes_per_request'] / off['kv_bytes_per_request']:.2f}x"
        rows.append("\n" + line)
    return _write("multiturn", args, results, rows)


def _routing(args, tokenizer) -> int:
    results = {
        "least loaded (weight 0)": run("disagg", True, args, tokenizer, routing_weight=0.0),
        "KV-aware (weight 1)": run("disagg", True, args, tokenizer, routing_weight=1.0),
    }
    rows = [
        "| routing | TTFT p50 turn 1 (ms) | TTFT p50 turns 2+ (ms) | requests/s | KV bytes/request | decode hit tokens "
        "| all hit tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        rows.append(
            f"| {name} | {1e3 * r['ttft_turn1_p50_s']:.0f} | {1e3 * r['ttft_later_p50_s']:.0f} "
            f"| {r['requests_per_s']:.3f} | {r['kv_bytes_per_request'] / 2**20:.1f} MiB | {r['decode_hit_tokens']:.0f} "
            f"| {r['prefix_hit_tokens']:.0f} |"
        )
    ll, kv = results.values()
    rows.append(
        f"\nKV-aware / least loaded: TTFT turns 2+ {kv['ttft_later_p50_s'] / ll['ttft_later_p50_s']:.2f}x, "
        f"KV bytes/request {kv['kv_bytes_per_request'] / ll['kv_bytes_per_request']:.2f}x, "
        f"requests/s {kv['requests_per_s'] / ll['requests_per_s']:.2f}x"
    )
    return _write("multiturn-routing", args, results, rows)


def _tiers(args, tokenizer) -> int:
    """Tiers off and on per mode, for each think time of ``--think-s`` (the load: short think
    times keep both deployments busy, long ones leave them idle between turns)."""
    results = {}
    for think in args.think_s:
        for mode in args.modes.split(","):
            for tiers in (False, True):
                name = f"{mode}, tiers {'on' if tiers else 'off'}, think {think:g} s"
                results[name] = run(mode, True, args, tokenizer, tiers=tiers, think_s=think)
    rows = [
        "| deployment | TTFT p50 turn 1 (ms) | TTFT p50 turns 2+ (ms) | requests/s | hit tokens | tier hit tokens |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        rows.append(
            f"| {name} | {1e3 * r['ttft_turn1_p50_s']:.0f} | {1e3 * r['ttft_later_p50_s']:.0f} "
            f"| {r['requests_per_s']:.3f} | {r['prefix_hit_tokens']:.0f} | {r['tier_hit_tokens']:.0f} |"
        )
    rows += [
        "",
        "| think (s) | mode | TTFT turns 2+ on/off | requests/s on/off | outputs identical |",
        "|---|---|---|---|---|",
    ]
    for think in args.think_s:
        for mode in args.modes.split(","):
            off = results[f"{mode}, tiers off, think {think:g} s"]
            on = results[f"{mode}, tiers on, think {think:g} s"]
            # of every turn of the workload: a turn that failed in either run is not the same
            same = sum(on["outputs"].get(k) == v for k, v in off["outputs"].items())
            rows.append(
                f"| {think:g} | {mode} | {on['ttft_later_p50_s'] / off['ttft_later_p50_s']:.2f}x "
                f"| {on['requests_per_s'] / off['requests_per_s']:.2f}x | {same}/{args.conversations * args.turns} |"
            )
    return _write("multiturn-tiers", args, results, rows)


def _seconds(text: str) -> list[float]:
    """``--think-s``: one number of seconds, or a comma list of them."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not seconds (a number or a comma list): {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"think times are not negative: {text!r}")
    return values


def _write(name: str, args, results: dict, rows: list[str]) -> int:
    settings = {k: v for k, v in vars(args).items()}
    md = f"settings {settings}\n\n" + "\n".join(rows) + "\n"
    out = results_dir()
    (out / f"{name}.json").write_text(json.dumps({"settings": settings, "results": results}, indent=2))
    (out / f"{name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
