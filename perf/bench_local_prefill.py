"""Benchmark: conditional disaggregation for short prompts at low load. The same disaggregated
deployment (1 prefill + 1 decode, cores split as in ``perf/lib/servers.py``) twice, side by side in
one run: every prefill remote (``local_prefill_max_tokens=0``) vs short prefills run on the
decode instance (``local_prefill_max_tokens=N``). One request at a time, distinct prompts (no
prefix reuse), prompt lengths up to ~200 tokens; TTFT p50 per length, and the decode instance's
``prefill_local_total`` / ``prefill_remote_total`` to show which path ran. Writes
``local_prefill.{json,md}`` to the results folder (``perf/results/``).

    python -m perf.bench_local_prefill [--lengths 16,64,128,200] [--reps 5] [--local-max 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from backend.client import stream_generate
from perf.lib import loadgen, servers
from perf.lib.metrics import metric_sum
from perf.lib.results import results_dir
from perf.lib.stats import median


def _prompt(tokenizer, n: int, seed: int) -> str:
    words = [f"w{seed}x{i}" for i in range(n * 2)]
    text = " ".join(words)
    ids = tokenizer.encode(text, add_special_tokens=False)[:n]
    return tokenizer.decode(ids)


def run(local_max: int, lengths: list[int], reps: int, tokenizer, tag: str) -> dict:
    with servers.started(
        "disagg",
        per_model={"decode": {"local_prefill_max_tokens": str(local_max)}},
        log_dir=results_dir() / f"local_prefill-{tag}",
    ) as server:
        stream_generate(server.grpc_url, "warm up", 4, ignore_eos=True)
        out = {}
        for n in lengths:
            ttfts = []
            for r in range(reps):
                res = stream_generate(server.grpc_url, _prompt(tokenizer, n, 1000 * n + r), 8, ignore_eos=True)
                if res.error:
                    raise RuntimeError(res.error)
                ttfts.append(res.ttft)
            out[n] = {"ttft_p50_s": median(ttfts), "ttft_all_s": ttfts}
        time.sleep(0.6)  # metrics refresh
        for path in ("prefill_local_total", "prefill_remote_total"):
            out[path] = metric_sum(server.metrics_url, path, model="decode_0")
        return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="16,64,128,200")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--local-max", type=int, default=256)
    args = p.parse_args(argv)
    tokenizer = loadgen.load_tokenizer()
    lengths = [int(x) for x in args.lengths.split(",")]
    remote = run(0, lengths, args.reps, tokenizer, "remote")
    local = run(args.local_max, lengths, args.reps, tokenizer, "local")
    rows = ["| prompt tokens | TTFT p50 remote (ms) | TTFT p50 local (ms) | local / remote |", "|---|---|---|---|"]
    for n in lengths:
        a, b = remote[n]["ttft_p50_s"], local[n]["ttft_p50_s"]
        rows.append(f"| {n} | {1e3 * a:.0f} | {1e3 * b:.0f} | {b / a:.2f}x |")
    paths = (
        f"paths: remote run {remote['prefill_remote_total']:.0f} remote / {remote['prefill_local_total']:.0f} local; "
        f"local run {local['prefill_remote_total']:.0f} remote / {local['prefill_local_total']:.0f} local"
    )
    md = "\n".join(rows) + "\n\n" + paths + "\n"
    out = results_dir()
    (out / "local_prefill.json").write_text(json.dumps({"remote": remote, "local": local}, indent=2, default=str))
    (out / "local_prefill.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
