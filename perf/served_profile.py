"""Calibrates an engine profile's served terms against real deployments on this machine.

The engine profile (``triton-disagg plan`` measures it in-process) says what a step costs the
engine. A served instance costs more: Triton's response path, the front, and on a machine whose
cores all run torch threads, Triton's own threads competing with them. This tool starts the
aggregated deployment (every core) and the disaggregated one (1 prefill + 1 decode, a core
each), measures in each

- decode inter-token latency with 1, 2, 4 and 8 streams decoding together (equal prompts sent
  at once; the median of each stream's last gaps), and
- the TTFT of one request at a time (``--prompt-tokens``),

and sets, next to the engine's own step model:

- ``served_overhead_s[threads]`` = [served ITL of 1 stream - the engine's single-token step,
  mean over 2-8 streams of served ITL - the engine's batched step];
- ``request_overhead_s`` = aggregated TTFT - the engine's prefill step - its overhead;
- ``handoff_s`` = disaggregated TTFT - the request overhead - the prefill of all prompt tokens but
  the last - the first decode step.

    python -m perf.served_profile --profile ENGINE.json --out SERVED.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from backend.engine.step_profile import EngineProfile
from backend.launch.deployment import core_split
from backend.planner.stats import median
from perf.lib import loadgen, results, servers

BATCHES = (1, 2, 4, 8)
BATCH_PROMPT = 128
BATCH_OUTPUT = 48


def measure(mode: str, tok, args, per_model: dict | None = None) -> dict:
    with servers.started(
        mode,
        overrides={
            "kv_cache_tokens": "16384",
            "max_num_batched_tokens": "512",
            "max_tokens_limit": "256",
            "weights_dtype": args.weights_dtype,
        },
        per_model=per_model,
    ) as server:
        loadgen.warm_up(server.grpc_url, tok)
        itl = {}
        for b in BATCHES:
            w = loadgen.Workload(
                rate=1000.0,
                n_requests=b,
                prompt_tokens=(BATCH_PROMPT, BATCH_PROMPT),
                output_tokens=(BATCH_OUTPUT, BATCH_OUTPUT),
                seed=b,
            )
            recs, _ = loadgen.run(server.grpc_url, tok, w, desc=f"{mode}, {b} streams")
            itl[b] = median(g for r in recs for g in r.gaps[-(BATCH_OUTPUT * 2 // 3) :])
        ttft = []
        for i in range(args.ttft_requests):
            n = args.prompt_tokens
            w = loadgen.Workload(rate=1000.0, n_requests=1, prompt_tokens=(n, n), output_tokens=(4, 4), seed=500 + i)
            recs, _ = loadgen.run(server.grpc_url, tok, w, desc=None)
            ttft.append(recs[0].ttft)
        return {"itl": itl, "ttft": median(ttft)}


def overheads(prof: EngineProfile, threads: int, itl: dict) -> list[float]:
    ctx = BATCH_PROMPT + BATCH_OUTPUT // 2
    diff = {b: itl[b] - prof.cost(threads).step_time([(1, ctx)] * b) for b in itl}
    return [max(0.0, diff[1]), max(0.0, statistics.fmean(diff[b] for b in itl if b > 1))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, help="engine profile from triton-disagg plan")
    p.add_argument("--out", required=True, help="where to save the calibrated profile")
    p.add_argument("--prompt-tokens", type=int, default=384)
    p.add_argument("--ttft-requests", type=int, default=3)
    p.add_argument("--weights-dtype", default="auto", help="weights_dtype (auto: serve's default)")
    args = p.parse_args(argv)
    prof = EngineProfile.load(Path(args.profile))
    prof.served_overhead_s = {}
    tok = loadgen.load_tokenizer()
    cores = len(os.sched_getaffinity(0))
    _, _, n_pre, n_dec = core_split()
    agg = measure("aggregated", tok, args)
    dis = measure("disagg", tok, args)
    prof.served_overhead_s[cores] = overheads(prof, cores, agg["itl"])
    if n_dec != cores:
        prof.served_overhead_s[n_dec] = overheads(prof, n_dec, dis["itl"])
    n = args.prompt_tokens
    prof.request_overhead_s = max(0.0, agg["ttft"] - prof.step_time(cores, [(n, 0)]))
    prof.handoff_s = max(
        0.0,
        dis["ttft"]
        - prof.request_overhead_s
        - prof.step_time(n_pre, [(n - 1, 0)])
        - prof.step_time(n_dec, [(1, n - 1)]),
    )
    prof.save(Path(args.out))
    measured = {"aggregated": agg, "disagg": dis}
    print(json.dumps(measured, indent=1))
    print(table(prof, measured, cores, n_dec, n))
    Path(args.out).with_suffix(".measured.json").write_text(json.dumps(measured, indent=1))
    print(f"calibrated profile: {args.out}  ({results.command_line('perf.served_profile')})")
    return 0


def table(prof, measured: dict, cores: int, n_dec: int, prompt_tokens: int) -> str:
    """Served decode ITL beside the engine's own step, per number of streams, and the calibrated
    terms, as markdown."""
    agg, dis = measured["aggregated"], measured["disagg"]

    def step_ms(threads: int, b: int) -> float:
        return prof.cost(threads).step_time([(1, 152)] * b) * 1e3

    rows = [
        f"Served decode inter-token latency against the engine's step (ms; aggregated on {cores} threads, the "
        f"disaggregated decode instance on {n_dec}):",
        "",
        "| streams | aggregated served | engine step | disagg decode served | engine step |",
        "|---|---|---|---|---|",
    ]
    for b in BATCHES:
        rows.append(
            f"| {b} | {agg['itl'][b] * 1e3:.1f} | {step_ms(cores, b):.1f} | {dis['itl'][b] * 1e3:.1f} | "
            f"{step_ms(n_dec, b):.1f} |"
        )
    served = "; ".join(
        f"{t} threads {v[0] * 1e3:.1f} / {v[1] * 1e3:.1f}" for t, v in sorted(prof.served_overhead_s.items())
    )
    rows += [
        "",
        "| calibrated term | value |",
        "|---|---|",
        f"| TTFT of one {prompt_tokens}-token request, aggregated / disagg (ms) | {agg['ttft'] * 1e3:.0f} / "
        f"{dis['ttft'] * 1e3:.0f} |",
        f"| served overhead per step, 1 stream / 2-8 streams (ms) | {served} |",
        f"| request overhead (ms) | {prof.request_overhead_s * 1e3:.1f} |",
        f"| KV handoff (ms) | {prof.handoff_s * 1e3:.1f} |",
    ]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
