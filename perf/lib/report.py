"""``perf/REPORT.md`` generated from the results: the newest successful envelope of each
benchmark (``perf/runs/``), one section each, in the order of ``triton-disagg bench --help``.
A benchmark whose flag switches to another measurement (``multiturn --routing``, ``formats
--server``: ``variants``) gets a section for each variant it has a run of.

A section gives the command, when and where it ran (CPU model, cores, torch, GPU, commit) and
the benchmark's own markdown table; a benchmark that wrote none gets its figures flattened into
a table. Benchmarks with no recorded run are listed as such. Figures from before the results
envelope (hand-written sections) live in the dated history files under ``perf/history/``.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path

from backend.engine.cpu_kernels import KernelPath
from backend.engine.formats import kernel_path_line
from perf.lib.machine import ROOT
from perf.lib.results import envelopes

REPORT = ROOT / "perf" / "REPORT.md"
HISTORY = ROOT / "perf" / "history"
MAX_FIGURE_ROWS = 60
_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")


def machine_line(m: dict) -> str:
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU"
    return (
        f"{m.get('cpu', '?')} ({m.get('cpu_id', '?')}), {m.get('cores', '?')} cores, "
        f"{m.get('memory_gib', '?')} GiB, torch {m.get('torch', '?')}{gpu}"
    )


def kernel_line(m: dict) -> str | None:
    """The run's kernel path as ``formats.kernel_path_line`` writes it: recorded by the run, or
    written from the path it recorded (runs before 2026-12-03 recorded none: None)."""
    if m.get("kernel_path_line"):
        return m["kernel_path_line"]
    path = m.get("kernel_path")
    return kernel_path_line(path=KernelPath.from_dict(path)) if path else None


def flatten(value, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted path, number or short string) for every scalar leaf of a JSON value."""
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in flatten(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(value, list):
        if len(value) > 16:
            return []  # a series (records, samples): its summary is elsewhere in the figures
        return [row for i, v in enumerate(value) for row in flatten(v, f"{prefix}[{i}]")]
    if isinstance(value, bool) or value is None:
        return [(prefix, value)]
    if isinstance(value, (int, float)):
        return [(prefix, value)]
    if isinstance(value, str) and len(value) <= 80:
        return [(prefix, value)]
    return []


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.4g}"
    return str(v)


def figures_table(figures: dict) -> list[str]:
    rows = [
        (f"{Path(name).name}: {path}" if len(figures) > 1 else path, v)
        for name, f in figures.items()
        for path, v in flatten(f)
    ]
    if not rows:
        return ["(the run wrote no figures)"]
    out = ["| figure | value |", "|---|---|"]
    out += [f"| `{k}` | {_fmt(v)} |" for k, v in rows[:MAX_FIGURE_ROWS]]
    if len(rows) > MAX_FIGURE_ROWS:
        out.append(f"| ... {len(rows) - MAX_FIGURE_ROWS} more in the envelope | |")
    return out


def printed_tables(output: str) -> str:
    """The markdown tables in what a run printed, each with the line before it as its caption."""
    lines, blocks, i = output.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            caption = _caption(lines, i)
            blocks.append("\n".join(([caption, ""] if caption else []) + lines[i:j]))
            i = j
        else:
            i += 1
    return "\n\n".join(blocks)


def _caption(lines: list[str], i: int) -> str:
    """The line that introduces the table starting at ``lines[i]``: the one before it, or the one
    before a blank line; none if that is a table's or an empty line."""
    for k in (i - 1, i - 2):
        if k < 0 or lines[k].startswith("|"):
            return ""
        if lines[k].strip():
            return lines[k].strip()
    return ""


def demote(markdown: str, level: int = 3) -> str:
    """The markdown with its headings pushed down so its top heading is ``level``."""
    lines = markdown.strip().splitlines()
    found = [len(m.group(1)) for line in lines if (m := re.match(r"(#+)\s", line))]
    shift = level - min(found) if found else 0
    return "\n".join(("#" * shift + line) if shift > 0 and re.match(r"#+\s", line) else line for line in lines)


def _images(markdown: str, run: dict, assets: Path, out: Path) -> str:
    """Copy the plots a markdown table shows next to the report; links rewritten to them."""
    written = {Path(f).name: Path(f) for f in run.get("files", [])}

    def copy(m: re.Match) -> str:
        src = written.get(Path(m.group(2)).name)
        src = src if src is None or src.is_absolute() else ROOT / src
        if src is None or not src.exists():
            return m.group(0)
        assets.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, assets / src.name)
        return f"![{m.group(1)}]({_rel(assets / src.name, out)})"

    return _IMAGE.sub(copy, markdown)


def section(name: str, what: str, run: dict, failed_after: list[dict], out: Path) -> list[str]:
    lines = [f"## {name}: {what}", ""]
    lines.append(f"`{' '.join(run['command'])}`")
    lines.append("")
    commit = run.get("commit", "?")
    lines.append(
        f"Ran {run.get('started', '?')} for {run.get('seconds', 0):.0f} s on {machine_line(run.get('machine', {}))}; "
        f"commit `{commit[:12]}{'+dirty' if commit.endswith('+dirty') else ''}`."
    )
    kernels = kernel_line(run.get("machine", {}))
    if kernels:
        lines += ["", kernels]
    if failed_after:
        last = failed_after[-1]
        newest = f"exit {last.get('exit_code')}, {last.get('started')}"
        lines.append(f"({len(failed_after)} later run(s) failed; the newest: {newest}.)")
    lines.append("")
    md = run.get("markdown") or {}
    printed = printed_tables(run.get("output", ""))
    if md:
        for _, text in sorted(md.items()):
            lines += [_images(demote(text), run, out.parent / "report" / "runs", out), ""]
    elif printed:
        lines += [demote(printed), ""]
    else:
        lines += figures_table(run.get("figures") or {}) + [""]
    return lines


def variant(run: dict, flags: tuple[str, ...]) -> tuple[str, ...]:
    """Which of ``flags`` (a benchmark's measurement-switching flags) the run's command carries."""
    return tuple(f for f in flags if f in run.get("command", []))


def generate(
    subcommands: dict[str, tuple[str, str]],
    runs: Path | None = None,
    out: Path = REPORT,
    variants: dict[str, tuple[str, ...]] | None = None,
) -> str:
    """The report's text, from the envelopes in ``runs`` (``perf/runs/``); written to ``out``.
    ``variants``: benchmark -> the flags that make a run another measurement (a section each)."""
    index = ["| benchmark | last good run | machine | seconds |", "|---|---|---|---|"]
    body: list[str] = []
    for name, (_, what) in subcommands.items():
        flags = (variants or {}).get(name, ())
        all_runs = envelopes(name, runs)
        keys = sorted({variant(r, flags) for r in all_runs} or {()}, key=lambda k: (len(k), k))
        for key in keys:
            title = " ".join((name, *key))
            mine = [r for r in all_runs if variant(r, flags) == key]
            good = [r for r in mine if r.get("exit_code") == 0]
            if not good:
                index.append(f"| `{title}` | not run yet{' (failed runs only)' if mine else ''} | | |")
                continue
            run = good[-1]
            failed_after = [r for r in mine[mine.index(run) + 1 :] if r.get("exit_code") != 0]
            m = run.get("machine", {})
            index.append(
                f"| [`{title}`](#{_anchor(title + ': ' + what)}) | {run.get('started', '?')[:16]} | "
                f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores{', ' + m['gpu'] if m.get('gpu') else ''} | "
                f"{run.get('seconds', 0):.0f} |"
            )
            body += section(title, what, run, failed_after, out)
    history = sorted(HISTORY.glob("REPORT-*.md")) if HISTORY.exists() else []
    head = [
        "# Measured figures",
        "",
        "Generated by `triton-disagg bench report` from the newest successful run of each benchmark",
        "(`perf/runs/`, one JSON envelope per `triton-disagg bench SUBCOMMAND` run: command, commit,",
        "machine, figures). Do not edit by hand: run the benchmark, then the report.",
        "",
    ]
    if history:
        links = ", ".join(f"[{p.stem}]({_rel(p, out)})" for p in history)
        head += [f"Figures measured before the envelopes (hand-written, dated): {links}.", ""]
    text = "\n".join(head + index + [""] + body).rstrip() + "\n"
    out.write_text(text)
    return text


def _rel(path: Path, report: Path) -> str:
    return Path(os.path.relpath(path, report.parent)).as_posix()


def _anchor(text: str) -> str:
    return re.sub(r"[^a-z0-9 _-]", "", text.lower()).replace(" ", "-")  # as GitHub makes heading anchors
