"""Checks the planner's simulator against measurements: every point ``perf.goodput`` measured is
replayed in the simulator with the same requests (arrival, prompt and output lengths) on the
same deployment, and the predicted TTFT p50, inter-token latency p90 (all gaps pooled) and SLO
attainment are set beside the measured ones.

Give it the profile calibrated by ``perf.served_profile`` (its served terms come from other
requests than the ones compared here).

    python -m perf.plan_check --goodput perf/results/goodput_<stamp>.json --profile PROFILE.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from backend.engine.step_profile import EngineProfile
from backend.planner.simulator import Deployment, InstanceSpec, RequestResult, simulate
from backend.planner.slo import SLO, attainment, summary
from backend.planner.workload import TraceRequest
from perf.lib import results

TOLERANCE = 0.25


def deployment_of(name: str, res: dict, cores: int) -> Deployment:
    b = res["budget"]
    if res["mode"] == "aggregated":
        return Deployment(name, aggregated=(InstanceSpec(cores, b, 32, 16384),))
    half = max(1, cores // 2)
    return Deployment(
        name, prefill=(InstanceSpec(half, b, 32, 16384),), decode=(InstanceSpec(cores - half or half, b, 32, 16384),)
    )


def measured_results(records: list[dict]) -> list[RequestResult]:
    """The measured requests in the simulator's terms (token times from arrival + TTFT + gaps)."""
    out = []
    for r in records:
        res = RequestResult(TraceRequest(r["offset"], r["prompt_tokens"], r["max_tokens"]))
        if r["error"] is None and r["n_tokens"] and r["ttft"] == r["ttft"]:
            t = r["offset"] + r["ttft"]
            res.token_times = [t]
            for g in r["gaps"]:
                t += g
                res.token_times.append(t)
        out.append(res)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--goodput", required=True, help="perf.goodput results JSON")
    p.add_argument("--profile", required=True)
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--out", default=None, help="markdown file for the table")
    args = p.parse_args(argv)
    data = json.loads(Path(args.goodput).read_text())
    prof = EngineProfile.load(Path(args.profile))
    s = data["slo"]
    slos = {"tight": SLO(s["ttft"], s["tight_itl"]), "loose": SLO(s["ttft"], s["loose_itl"])}
    lines = [
        "| deployment | rate | TTFT p50 measured / predicted (s) | ratio | ITL p90 measured / predicted (ms) | ratio "
        "| attainment tight: measured / predicted | loose |",
        "|---|---|---|---|---|---|---|---|",
    ]
    within, total = 0, 0
    for name, res in data["results"].items():
        dep = deployment_of(name, res, args.cores)
        for rate, point in sorted(res["points"].items(), key=lambda kv: float(kv[0])):
            meas = measured_results(point["records"])
            pred = simulate(dep, prof, [r.request for r in meas])
            m, q = summary(meas), summary(pred)
            ttft_r, itl_r = q["ttft_p50"] / m["ttft_p50"], q["itl_p90"] / m["itl_p90"]
            for r in (ttft_r, itl_r):
                total += 1
                within += abs(r - 1) <= TOLERANCE
            att = {k: (attainment(meas, v), attainment(pred, v)) for k, v in slos.items()}
            lines.append(
                f"| {name} | {rate} | {m['ttft_p50']:.2f} / {q['ttft_p50']:.2f} | {ttft_r:.2f} | "
                f"{m['itl_p90'] * 1e3:.0f} / {q['itl_p90'] * 1e3:.0f} | {itl_r:.2f} | "
                f"{att['tight'][0] * 100:.0f}% / {att['tight'][1] * 100:.0f}% | "
                f"{att['loose'][0] * 100:.0f}% / {att['loose'][1] * 100:.0f}% |"
            )
    lines.append(f"\n{within} of {total} predictions within {TOLERANCE:.0%} of the measurement.")
    lines += ["", "```", results.command_line("perf.plan_check"), "```"]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
