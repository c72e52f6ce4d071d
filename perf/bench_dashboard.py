"""The Grafana dashboard's panels (``deploy/grafana/triton-disagg.json``) as PNG charts, for people
who do not run Grafana: a disaggregated deployment with the real Prometheus that ``serve
--prometheus`` starts, under a phased Poisson load (a rate per phase; prompts that share a
system prefix, so the prefix cache has work), then every panel's queries over the run through
Prometheus's ``query_range``, drawn one chart a panel (``dashboard_<n>.png``) with matplotlib.
Writes ``dashboard.{json,md}`` (the markdown shows the charts; ``bench report`` copies them next
to ``perf/REPORT.md``).

    python -m perf.bench_dashboard [--phases 40:0.2,40:0.6,40:0.3] [--output-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import requests

from backend.client import stream_generate
from backend.planner.workload import parse_phases, phased_arrivals
from perf.lib import servers
from perf.lib.loadgen import load_tokenizer, make_prompt, replay
from perf.lib.machine import ROOT, cpu_model
from perf.lib.results import results_dir

DASHBOARD = ROOT / "deploy" / "grafana" / "triton-disagg.json"
SYSTEM = "You are a careful assistant. Answer in one short paragraph and cite no sources. " * 6


def _legend(fmt: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: str(labels.get(m.group(1), "")), fmt) or json.dumps(labels)


def _series(prometheus: str, expr: str, start: float, end: float, step_s: float) -> list[tuple[dict, list]]:
    reply = requests.get(
        f"{prometheus}/api/v1/query_range",
        params={"query": expr, "start": start, "end": end, "step": step_s},
        timeout=30,
    )
    reply.raise_for_status()
    return [(r["metric"], r["values"]) for r in reply.json()["data"]["result"]]


def draw(panels: list[dict], prometheus: str, start: float, end: float, step_s: float, out: Path) -> list[dict]:
    """One PNG a panel; what each shows (series drawn, points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = []
    for i, panel in enumerate(panels, 1):
        fig, ax = plt.subplots(figsize=(7, 3.2))
        n_series = n_points = 0
        for target in panel["targets"]:
            for labels, values in _series(prometheus, target["expr"], start, end, step_s):
                points = [(float(t) - start, float(v)) for t, v in values if v not in ("NaN", "+Inf", "-Inf")]
                if not points:
                    continue
                xs, ys = zip(*points)
                ax.plot(xs, ys, label=_legend(target.get("legendFormat", ""), labels)[:40])
                n_series, n_points = n_series + 1, n_points + len(points)
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("seconds into the run")
        if unit and unit != "short":
            ax.set_ylabel(unit)
        if n_series:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "no data in this run", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        path = out / f"dashboard_{i}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        drawn.append({"panel": panel["title"], "file": path.name, "series": n_series, "points": n_points})
    return drawn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default="40:0.2,40:0.6,40:0.3", help="seconds:requests-per-second, ...")
    p.add_argument("--prompt-tokens", type=int, default=120, help="each prompt's own part, after the shared prefix")
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--step-s", type=float, default=5.0, help="the charts' resolution (Prometheus scrapes every 5 s)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    phases = parse_phases(args.phases)
    rng = random.Random(args.seed)
    offsets = list(phased_arrivals(phases, rng))
    tokenizer = load_tokenizer()
    prompts = [SYSTEM + make_prompt(tokenizer, args.prompt_tokens, rng) for _ in offsets]
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    with servers.started("disagg", log_dir=out / "dashboard", prometheus=True) as server:
        prometheus = server.prometheus
        assert prometheus is not None
        stream_generate(server.grpc_url, "warm up", 4, ignore_eos=True)
        time.sleep(2 * prometheus.interval_s)  # a scrape or two before the load
        start = time.time()

        def send(i: int, _t: float) -> None:
            res = stream_generate(server.grpc_url, prompts[i], args.output_tokens, ignore_eos=True, temperature=0.0)
            if res.error:
                errors.append(res.error)

        replay(offsets, send, drain_timeout_s=300, desc="dashboard load")
        time.sleep(3 * prometheus.interval_s)  # the last scrapes and rule evaluations
        end = time.time()
        panels = json.loads(DASHBOARD.read_text())["panels"]
        drawn = draw(panels, prometheus.url, start, end, args.step_s, out)
    result = {
        "cpu": cpu_model(),
        "args": vars(args),
        "requests": len(offsets),
        "errors": errors[:5],
        "seconds": end - start,
        "panels": drawn,
    }
    (out / "dashboard.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"{len(offsets)} requests ({len(errors)} failed) over {end - start:.0f} s in phases {args.phases} "
        f"(seconds:requests/s), a disaggregated deployment (1 prefill + 1 decode instance) scraped by the "
        f"Prometheus `serve --prometheus` starts; each panel of `deploy/grafana/triton-disagg.json` drawn from "
        f"its queries over the run. CPU: {cpu_model()}.",
        "",
        "| panel | series | points | chart |",
        "|---|---|---|---|",
    ]
    lines += [f"| {d['panel']} | {d['series']} | {d['points']} | ![{d['panel']}]({d['file']}) |" for d in drawn]
    markdown = "\n".join(lines) + "\n"
    (out / "dashboard.md").write_text(markdown)
    print(markdown)
    empty = [d["panel"] for d in drawn if not d["series"]]
    print(f"panels without data in this run: {empty or 'none'}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
