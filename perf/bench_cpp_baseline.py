"""Benchmark: one stream through our server against a quantized C++ CPU server on the same
machine, alternated in one run.

The baseline is llama.cpp's server through ``llama-cpp-python[server]`` (installed on first use
into ``.venv/tools/llama-cpp``; it compiles llama.cpp, minutes), serving the Q4_1 GGUF that our
checkpoint is prepared from. Ours is ``triton-disagg``'s aggregated deployment at ``serve``'s
defaults unless told otherwise (``--weights``, default auto: the format ``serve`` picks;
``--engine-threads``, default 0: ``serve``'s, every core; the lean layer loop). Each round starts one server, warms it
up, times ``--streams`` streams of ``--tokens`` tokens one after the other (greedy, end of
sequence ignored), stops it, then does the same with the other; which goes first alternates.
Reports tokens/s after the first token (best and median per round), ITL p50, and the ratio
ours/baseline per round and over the rounds' medians. Writes JSON to the results folder
(``perf/results/``). The llama.cpp server is started by ``perf/lib/servers.py``.

    python -m perf.bench_cpp_baseline [--rounds 3] [--baseline-threads 2] [--engine-threads 0] [--weights auto]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from backend.planner import stats
from perf.lib.progress import bar
from perf.lib.results import results_dir
from perf.lib.servers import start_llama_cpp

PROMPT = "Explain how a refrigerator works."


def _summary(streams: list[list[float]]) -> dict:
    """Over the streams (each one's token arrival times): tokens/s after the first token, best
    and median, and the median of each stream's median gap between tokens (ms)."""
    rates = [stats.decode_rate(times) for times in streams]
    return {
        "tok_s_best": max(rates),
        "tok_s_median": stats.median(rates),
        "itl_p50_ms": stats.median(1e3 * stats.median(stats.gaps(times)) for times in streams),
    }


def run_ours(weights: str, threads: int, streams: int, tokens: int) -> dict:
    from backend.client import stream_generate
    from perf.lib import servers

    with servers.started(
        "aggregated",
        overrides={"weights_dtype": weights},
        per_model={"llm": {"num_threads": str(threads)}} if threads else None,
        log_dir=results_dir() / f"cpp-baseline-ours-{weights}",
    ) as server:
        stream_generate(server.grpc_url, "warm up", 8, ignore_eos=True)
        runs = []
        for _ in range(streams):
            res = stream_generate(server.grpc_url, PROMPT, tokens, ignore_eos=True, temperature=0.0)
            if res.error is not None:
                raise RuntimeError(f"our server: {res.error}")
            runs.append(list(res.times))
        return _summary(runs)


def run_baseline(gguf: Path, threads: int, streams: int, tokens: int) -> dict:
    with start_llama_cpp(gguf, threads, results_dir() / "cpp-baseline-llama-cpp" / "server.log") as server:
        runs = server.timed_streams(PROMPT, tokens, streams)
    return {**_summary(runs), "tokens_streamed": len(runs[-1])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=3, help="streams per server per round")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--weights", default="auto", help="our weights_dtype (auto: serve's default)")
    p.add_argument(
        "--engine-threads", type=int, default=0, help="our engine's num_threads (0: serve's default, every core)"
    )
    p.add_argument("--baseline-threads", type=int, default=len(os.sched_getaffinity(0)))
    args = p.parse_args(argv)
    from build_scripts.prepare_model import find_packaged_gguf

    gguf = find_packaged_gguf()
    rounds = []
    for i in bar(range(args.rounds), "rounds"):
        if i % 2 == 0:  # alternate which server goes first: the second run of a pair can be slower
            ours = run_ours(args.weights, args.engine_threads, args.streams, args.tokens)
            base = run_baseline(gguf, args.baseline_threads, args.streams, args.tokens)
        else:
            base = run_baseline(gguf, args.baseline_threads, args.streams, args.tokens)
            ours = run_ours(args.weights, args.engine_threads, args.streams, args.tokens)
        ratio = ours["tok_s_median"] / base["tok_s_median"]
        rounds.append({"ours": ours, "llama_cpp": base, "ratio_median": ratio})
        print(f"round {i}: ours {ours}, llama.cpp {base}, ratio {ratio:.2f}", flush=True)
    rows = [
        "| round | ours tok/s (median, best) | ours ITL p50 ms | llama.cpp tok/s (median, best) "
        "| llama.cpp ITL p50 ms | ours / llama.cpp |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds):
        o, b = r["ours"], r["llama_cpp"]
        rows.append(
            f"| {i} | {o['tok_s_median']:.1f}, {o['tok_s_best']:.1f} | {o['itl_p50_ms']:.1f} "
            f"| {b['tok_s_median']:.1f}, {b['tok_s_best']:.1f} | {b['itl_p50_ms']:.1f} | {r['ratio_median']:.2f}x |"
        )
    overall = stats.median(r["ratio_median"] for r in rounds)
    md = f"settings {vars(args)}\n\n" + "\n".join(rows) + f"\n\nmedian ratio over rounds: {overall:.2f}x\n"
    path = results_dir() / f"cpp_baseline_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps({"settings": vars(args), "rounds": rounds, "median_ratio": overall}, indent=2))
    print(md)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
