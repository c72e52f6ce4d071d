"""One stream's decode speed through a real server, per mode: starts an aggregated deployment and
a disaggregated one (1 prefill + 1 decode, cores split), sends a few single greedy streams to each,
and prints each stream's tokens/s after its first token and TTFT (JSON lines, then a summary
and a table). With ``--concurrency N`` it then sends N streams at once, on the same server, and
reports their inter-token latency p50 against the single streams' (the engine's batch-N decode
step against its batch-1 step, as a client sees it). Writes ``one_stream_<stamp>.json`` to the
results folder. Used to compare two commits side by side (run it in each checkout, alternating).

With ``--tracing``, instead: what tracing costs. Two deployments per mode, one exporting every
request's spans (``otlp_endpoint``) to an OTLP receiver in this process, one not; the streams
alternate between them (off, on, on, off, ...), and the table gives tokens/s and TTFT with
tracing against without.

    python -m perf.one_stream [--tokens 128] [--streams 5] [--modes aggregated,disagg] [--concurrency 8]
    python -m perf.one_stream --tracing [--streams 8]
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time

from backend.client import stream_generate
from backend.planner.stats import gaps, median
from perf.lib import servers
from perf.lib.machine import cpu_model
from perf.lib.results import results_dir

PROMPT = "Write a long story about a lighthouse keeper and the sea. " * 4


def _concurrent(url: str, n: int, tokens: int) -> list:
    """``n`` greedy streams started together; their results."""
    out: list = [None] * n

    def one(i: int) -> None:
        out[i] = stream_generate(url, f"{i} concurrent {PROMPT}", tokens, ignore_eos=True, temperature=0.0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return out


def run_mode(mode: str, tokens: int, streams: int, overrides: dict, concurrency: int = 0) -> dict:
    with servers.started(mode, overrides=overrides) as server:
        stream_generate(server.grpc_url, "warm up", 8, ignore_eos=True)
        rates: list[float] = []
        ttfts: list[float] = []
        itls: list[float] = []
        for i in range(streams):
            res = stream_generate(server.grpc_url, f"{i} {PROMPT}", tokens, ignore_eos=True, temperature=0.0)
            if res.error or len(res.times) < 2:
                raise RuntimeError(f"{mode}: stream {i} failed: {res.error}")
            rates.append((len(res.token_ids) - 1) / (res.times[-1] - res.times[0]))
            ttfts.append(res.ttft)
            itls.append(median(gaps(res.times)))
            print(json.dumps({"mode": mode, "stream": i, "tok_s": round(rates[-1], 2), "ttft_s": round(res.ttft, 3)}))
        summary = {
            "tok_s_median": median(rates),
            "tok_s_best": max(rates),
            "ttft_median": median(ttfts),
            "itl_p50_s": median(itls),
            "tok_s": rates,
            "ttft_s": ttfts,
        }
        if concurrency:
            together = _concurrent(server.grpc_url, concurrency, tokens)
            failed = [r.error for r in together if r.error or len(r.times) < 2]
            if failed:
                raise RuntimeError(f"{mode}: {len(failed)} of {concurrency} concurrent streams failed: {failed[:2]}")
            # the gaps while all N streams decode: from the last first token to the first last one
            start, end = max(r.times[0] for r in together), min(r.times[-1] for r in together)
            shared = [g for r in together for a, g in zip(r.times[1:], gaps(r.times)) if start < a <= end]
            if not shared:
                raise RuntimeError(
                    f"{mode}: the {concurrency} concurrent streams never decoded together (the first ended before "
                    f"the last one's first token: raise --tokens)"
                )
            itl = median(shared)
            summary["concurrent"] = {
                "streams": concurrency,
                "itl_p50_s": itl,
                "itl_ratio_to_one_stream": itl / summary["itl_p50_s"],
                "gaps_counted": len(shared),
            }
            print(json.dumps({"mode": mode, "concurrent": summary["concurrent"]}))
        return summary


def run_tracing(mode: str, tokens: int, streams: int, overrides: dict) -> dict:
    """Tokens/s and TTFT of single streams alternating between a deployment that traces every
    request and one that does not (both up at once: one serves at a time)."""
    from backend.cluster.otlp_receiver import OTLPReceiver

    traced = {**overrides, "otlp_endpoint": ""}
    with OTLPReceiver() as receiver:
        traced["otlp_endpoint"] = receiver.url
        with servers.started(mode, overrides=overrides) as off, servers.started(mode, overrides=traced) as on:
            figures: dict[str, dict[str, list[float]]] = {k: {"tok_s": [], "ttft_s": []} for k in ("off", "on")}
            for server in (off, on):
                stream_generate(server.grpc_url, "warm up", 8, ignore_eos=True)
            for i in range(streams):
                order = [("off", off), ("on", on)] if i % 2 == 0 else [("on", on), ("off", off)]
                for name, server in order:
                    res = stream_generate(server.grpc_url, f"{i} {PROMPT}", tokens, ignore_eos=True, temperature=0.0)
                    if res.error or len(res.times) < 2:
                        raise RuntimeError(f"{mode} tracing {name}: stream {i} failed: {res.error}")
                    figures[name]["tok_s"].append((len(res.token_ids) - 1) / (res.times[-1] - res.times[0]))
                    figures[name]["ttft_s"].append(res.ttft)
                    rate = round(figures[name]["tok_s"][-1], 2)
                    print(json.dumps({"mode": mode, "tracing": name, "stream": i, "tok_s": rate}))
            time.sleep(6.0)  # the last spans' export (the SDK sends a batch every 5 s)
            spans = len(receiver.spans())
    off_f, on_f = figures["off"], figures["on"]
    return {
        "off": {"tok_s_median": median(off_f["tok_s"]), "ttft_median": median(off_f["ttft_s"])},
        "on": {"tok_s_median": median(on_f["tok_s"]), "ttft_median": median(on_f["ttft_s"])},
        "tok_s_ratio": median(on_f["tok_s"]) / median(off_f["tok_s"]),
        "ttft_ratio": median(on_f["ttft_s"]) / median(off_f["ttft_s"]),
        "spans_received": spans,
        "figures": figures,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=5)
    p.add_argument("--modes", default="aggregated,disagg")
    p.add_argument("--weights-dtype", default="auto", help="weights_dtype (auto: serve's default)")
    p.add_argument("--concurrency", type=int, default=0, help="then N streams at once: their ITL p50 (0: none)")
    p.add_argument("--tracing", action="store_true", help="instead: tracing on against off, streams alternating")
    args = p.parse_args(argv)
    if args.concurrency < 0:
        p.error("--concurrency must be >= 0")
    overrides = {"weights_dtype": args.weights_dtype, "max_tokens_limit": str(max(256, args.tokens))}
    if args.tracing:
        return _tracing_main(args, overrides)
    summary = {m: run_mode(m, args.tokens, args.streams, overrides, args.concurrency) for m in args.modes.split(",")}
    result = {"cpu": cpu_model(), "machine": platform.machine(), "args": vars(args), "summary": summary}
    print(json.dumps(result))
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"one_stream_{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(result, indent=1))
    print(f"\n{args.streams} greedy streams of {args.tokens} tokens, one at a time, {args.weights_dtype} weights:\n")
    print("| deployment | tok/s after the first token, median | best | TTFT median (s) | ITL p50 (ms) |")
    print("|---|---|---|---|---|")
    for mode, s in summary.items():
        print(
            f"| {mode} | {s['tok_s_median']:.1f} | {s['tok_s_best']:.1f} | {s['ttft_median']:.3f} "
            f"| {1e3 * s['itl_p50_s']:.1f} |"
        )
    for mode, s in summary.items():
        if "concurrent" in s:
            c = s["concurrent"]
            print(
                f"\n{mode}: {c['streams']} concurrent streams, ITL p50 {1e3 * c['itl_p50_s']:.1f} ms, "
                f"{c['itl_ratio_to_one_stream']:.2f}x one stream's ({c['gaps_counted']} gaps)"
            )
    return 0


def _tracing_main(args, overrides: dict) -> int:
    summary = {m: run_tracing(m, args.tokens, args.streams, overrides) for m in args.modes.split(",")}
    result = {"cpu": cpu_model(), "machine": platform.machine(), "args": vars(args), "summary": summary}
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"one_stream_tracing_{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(result, indent=1))
    print(
        f"\n{args.streams} greedy streams of {args.tokens} tokens per deployment, alternating between tracing off "
        f"and on (every request's spans exported over OTLP/HTTP to a receiver in the benchmark), "
        f"{args.weights_dtype} weights; CPU: {cpu_model()}:\n"
    )
    print("| deployment | tok/s off | tok/s on | on/off | TTFT off (s) | TTFT on (s) | on/off | spans received |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, s in summary.items():
        print(
            f"| {mode} | {s['off']['tok_s_median']:.1f} | {s['on']['tok_s_median']:.1f} | {s['tok_s_ratio']:.3f} "
            f"| {s['off']['ttft_median']:.3f} | {s['on']['ttft_median']:.3f} | {s['ttft_ratio']:.3f} "
            f"| {s['spans_received']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
