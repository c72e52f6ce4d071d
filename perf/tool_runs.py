"""What the runs of NVIDIA's benchmark tools (``perf/genai_perf.py``, ``perf/aiperf.py``) share:
reading their JSON exports, the summary table, and the loop over deployments (start one, run
the tool, stop it; an error is reported for that deployment and the next one still runs)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

LATENCIES = ("time_to_first_token", "inter_token_latency", "request_latency")


def find(obj, tag: str):
    """The first dict under key ``tag`` anywhere in an export (the layouts differ by tool and version)."""
    if isinstance(obj, dict):
        if isinstance(obj.get(tag), dict):
            return obj[tag]
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            found = find(v, tag)
            if found is not None:
                return found
    return None


def summarize(export: dict, rates: tuple[str, ...]) -> dict:
    out = {}
    for name in LATENCIES:
        m = find(export, name) or {}
        out[name] = {k: m.get(k) for k in ("unit", "avg", "p50", "p90", "p99") if k in m}
    for name in rates:
        m = find(export, name) or {}
        out[name] = {k: m.get(k) for k in ("unit", "avg") if k in m}
    return out


def table(results: dict, rates: tuple[str, ...]) -> str:
    head = (
        "| deployment | TTFT p50 / p90 (ms) | ITL p50 / p90 (ms) | request latency p50 (ms) | "
        + " | ".join(rates)
        + " |"
    )
    rows = [head, "|" + "---|" * (4 + len(rates))]
    for mode, r in results.items():
        if "error" in r:
            rows.append(f"| {mode} | error: {r['error']} |" + " |" * (3 + len(rates)))
            continue
        t, i, lat = (r[n] for n in LATENCIES)
        cells = [
            mode,
            f"{t.get('p50') or 0:.0f} / {t.get('p90') or 0:.0f}",
            f"{i.get('p50') or 0:.1f} / {i.get('p90') or 0:.1f}",
            f"{lat.get('p50') or 0:.0f}",
            *(f"{r[n].get('avg') or 0:.2f}" for n in rates),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def run_deployments(
    modes: list[str],
    results_dir: Path,
    start: Callable[[str, Path], tuple[str, Callable[[], None]]],
    run: Callable[[str, Path], dict],
    title: str,
    settings: dict,
    rates: tuple[str, ...],
) -> int:
    """For each mode: ``start(mode, log_dir)`` -> (target, stop); ``run(target, artifact_dir)`` ->
    summary. Writes ``summary.json`` and ``summary.md``; 0 when every deployment ran."""
    results_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for mode in modes:
        stop = None
        try:
            target, stop = start(mode, results_dir / f"logs-{mode}")
            results[mode] = run(target, results_dir / mode)
        except Exception as exc:  # report the exact error and go on with the next deployment
            results[mode] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            if stop is not None:
                stop()
    (results_dir / "summary.json").write_text(json.dumps({"settings": settings, "results": results}, indent=2))
    md = f"{title}, settings {settings}\n\n{table(results, rates)}\n"
    (results_dir / "summary.md").write_text(md)
    print(md)
    return 0 if all("error" not in r for r in results.values()) else 1


def parser(doc: str, results: Path, url_help: str) -> argparse.ArgumentParser:
    """The options both tools' scripts take: deployments, output folder, target, the workload."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="aggregated,disagg")
    p.add_argument("--out", default=str(results), help="folder for the exports and the summary")
    p.add_argument("--url", default=None, help=f"{url_help} (then one mode: 'running')")
    p.add_argument("--model-name", default="llm")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--isl", type=int, default=128, help="synthetic prompt tokens")
    p.add_argument("--osl", type=int, default=32, help="output tokens per request")
    return p
