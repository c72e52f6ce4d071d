"""One stream's decode speed through a real server, per mode: starts an aggregated deployment and
a disaggregated one (1 prefill + 1 decode, cores split), sends a few single greedy streams to each,
and prints each stream's tokens/s after its first token and TTFT (JSON lines, then a summary
and a table). Writes ``one_stream_<stamp>.json`` to the results folder. Used to compare two
commits side by side (run it in each checkout, alternating).

    python -m perf.one_stream [--tokens 128] [--streams 5] [--modes aggregated,disagg]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from backend.client import stream_generate
from perf.lib import servers
from perf.lib.machine import cpu_model
from perf.lib.results import results_dir
from perf.lib.stats import median

PROMPT = "Write a long story about a lighthouse keeper and the sea. " * 4


def run_mode(mode: str, tokens: int, streams: int, overrides: dict) -> dict:
    with servers.started(mode, overrides=overrides) as server:
        stream_generate(server.grpc_url, "warm up", 8, ignore_eos=True)
        rates: list[float] = []
        ttfts: list[float] = []
        for i in range(streams):
            res = stream_generate(server.grpc_url, f"{i} {PROMPT}", tokens, ignore_eos=True, temperature=0.0)
            if res.error or len(res.times) < 2:
                raise RuntimeError(f"{mode}: stream {i} failed: {res.error}")
            rates.append((len(res.token_ids) - 1) / (res.times[-1] - res.times[0]))
            ttfts.append(res.ttft)
            print(json.dumps({"mode": mode, "stream": i, "tok_s": round(rates[-1], 2), "ttft_s": round(res.ttft, 3)}))
        return {
            "tok_s_median": median(rates),
            "tok_s_best": max(rates),
            "ttft_median": median(ttfts),
            "tok_s": rates,
            "ttft_s": ttfts,
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=5)
    p.add_argument("--modes", default="aggregated,disagg")
    p.add_argument("--weights-dtype", default="auto", help="weights_dtype (auto: serve's default)")
    args = p.parse_args(argv)
    overrides = {"weights_dtype": args.weights_dtype, "max_tokens_limit": str(max(256, args.tokens))}
    summary = {m: run_mode(m, args.tokens, args.streams, overrides) for m in args.modes.split(",")}
    result = {"cpu": cpu_model(), "machine": platform.machine(), "args": vars(args), "summary": summary}
    print(json.dumps(result))
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"one_stream_{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(result, indent=1))
    print(f"\n{args.streams} greedy streams of {args.tokens} tokens, one at a time, {args.weights_dtype} weights:\n")
    print("| deployment | tok/s after the first token, median | best | TTFT median (s) |")
    print("|---|---|---|---|")
    for mode, s in summary.items():
        print(f"| {mode} | {s['tok_s_median']:.1f} | {s['tok_s_best']:.1f} | {s['ttft_median']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
