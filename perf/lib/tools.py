"""External benchmark tools: their private venvs, perf_analyzer's binary, and the driver NVIDIA's
tools (genai-perf, AIPerf) share.

- ``ensure_tool``: a virtual environment per tool under ``.venv/tools/<name>`` (their pinned
  dependencies differ from the project's, so they never share its ``.venv``), created on first
  use from the package registry and reused after;
- ``PA``, ``ensure_libb64``, ``pa_env``: NVIDIA perf_analyzer from the manylinux
  ``tritonclient==2.50.0`` wheel that ``scripts/setup.sh`` unpacks into ``.venv/perf_analyzer/``,
  the Debian library it needs and the environment that finds ``libcudart.so.12``;
- ``parser``, ``profile``, ``drive``: one run of genai-perf or AIPerf per deployment (start it,
  run the tool, read its JSON export, stop it; an error is reported for that deployment and the
  next one still runs), then ``summary.json`` and a markdown table ``summary.md``.
"""

from __future__ import annotations

import argparse
import ctypes.util
import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from perf.lib.machine import ROOT

LATENCIES = ("time_to_first_token", "inter_token_latency", "request_latency")
PA = ROOT / ".venv" / "perf_analyzer" / "tritonclient-2.50.0.data" / "data" / "bin" / "perf_analyzer"

# start(mode, log_dir) -> (target, stop or None)
Start = Callable[[str, Path], tuple[str, Callable[[], None] | None]]


def ensure_tool(
    name: str, requirement: str, executable: str, extra: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Path:
    """The path of ``executable`` in the tool's venv, installing ``requirement`` (and the
    requirements in ``extra``, in the same pip run, with ``env`` added to pip's environment:
    build settings) if needed; a venv installed with other requirements or settings is
    installed again. One install at a time per tool (a file lock): a caller that finds another
    process installing it (``perf/install_tools.py`` in the background of the test run) waits
    for that install instead of starting its own."""
    venv = ROOT / ".venv" / "tools" / name
    exe = venv / "bin" / executable
    stamp = venv / ".requirement"
    wanted = " ".join((requirement, *extra, *(f"{k}={v}" for k, v in sorted((env or {}).items()))))
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if exe.is_file() and stamp.is_file() and stamp.read_text() == wanted:
            return exe
        if not (venv / "bin" / "python").is_file():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        print(f"[{name}] installing {wanted} into {venv} ...", flush=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        # pip's wheel cache does not know the build settings: built anew when there are any
        fresh = (["--force-reinstall"] if stamp.is_file() else []) + (
            ["--no-cache-dir"] if env or stamp.is_file() else []
        )
        subprocess.run([*pip, *fresh, requirement, *extra], check=True, env={**os.environ, **(env or {})})
        stamp.write_text(wanted)
        return exe


def ensure_perf_analyzer() -> Path:
    """perf_analyzer's path, with the library it needs installed; exits when it is missing."""
    if not PA.is_file():
        raise SystemExit(f"{PA} is missing; run scripts/setup.sh")
    ensure_libb64()
    return PA


def ensure_libb64() -> None:
    """Debian's ``libb64-0d`` (perf_analyzer links it), installed with apt-get when we are root."""
    if ctypes.util.find_library("b64"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SystemExit("perf_analyzer needs libb64-0d: run `apt-get install -y libb64-0d` as root")
    if subprocess.run(["apt-get", "install", "-y", "-q", "libb64-0d"]).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], check=True)  # a fresh machine has no package lists yet
        subprocess.run(["apt-get", "install", "-y", "-q", "libb64-0d"], check=True)


def pa_env() -> dict:
    """The environment with pip's ``libcudart.so.12`` (``nvidia-cuda-runtime-cu12``) on LD_LIBRARY_PATH."""
    import nvidia.cuda_runtime

    cudart = Path(list(nvidia.cuda_runtime.__path__)[0]) / "lib"
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(cudart), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


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


@dataclass(frozen=True)
class Tool:
    """One of NVIDIA's profilers as the driver runs it."""

    name: str  # its venv under .venv/tools/ and its command
    requirement: str  # pip's, pinned: ``name==version``
    title: str  # in the summary
    subdir: str  # of the results folder: the default ``--out``
    export: str  # the JSON export its ``profile`` writes
    rates: tuple[str, ...]  # the throughput figures summarized beside the latencies

    @property
    def version(self) -> str:
        return self.requirement.split("==")[1]

    def install(self) -> Path:
        """Its command, installed on first use (:func:`ensure_tool`)."""
        return ensure_tool(self.name, self.requirement, self.name)


def profile(tool: Tool, cmd: list[str], artifact_dir: Path, env: dict | None = None) -> dict:
    """Run one ``profile`` command of ``tool`` (in ``artifact_dir``'s parent) and summarize the
    newest export it wrote under ``artifact_dir``."""
    print(" ".join(cmd), flush=True)
    artifact_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(cmd, env=env, check=True, cwd=artifact_dir.parent)
    exports = sorted(artifact_dir.rglob(tool.export))
    if not exports:
        raise RuntimeError(f"{tool.title} wrote no {tool.export} under {artifact_dir}")
    return summarize(json.loads(exports[-1].read_text()), tool.rates)


def run_deployments(
    modes: list[str],
    results_dir: Path,
    start: Start,
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


def parser(doc: str, tool: Tool, url_help: str) -> argparse.ArgumentParser:
    """The options both tools' scripts take: deployments, output folder, target, the workload."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="aggregated,disagg")
    p.add_argument(
        "--out",
        default=None,
        help=f"folder for the exports and the summary (default: {tool.subdir}/ in the results folder)",
    )
    p.add_argument("--url", default=None, help=f"{url_help} (then one mode: 'running')")
    p.add_argument("--model-name", default="llm")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--isl", type=int, default=128, help="synthetic prompt tokens")
    p.add_argument("--osl", type=int, default=32, help="output tokens per request")
    return p


def load_options(args: argparse.Namespace) -> list[str]:
    """The load both tools' ``profile`` take alike: ``--concurrency``, ``--requests``, 2 warm-ups."""
    load = {"--concurrency": args.concurrency, "--request-count": args.requests, "--warmup-request-count": 2}
    return [str(x) for option in load.items() for x in option]


def drive(
    args: argparse.Namespace,
    tool: Tool,
    start: Callable[[str, Path, Path], tuple[str, Callable[[], None] | None]],
    run: Callable[[Path, str, Path, Path, argparse.Namespace], dict],
    settings: tuple[str, ...],
) -> int:
    """Install ``tool``, then ``run_deployments`` over ``--modes`` (or the one deployment at
    ``--url``, mode ``running``) into ``--out`` (default: the tool's folder in the results
    folder): ``start(mode, log_dir, model_dir)`` -> (target, stop), ``run(exe, target,
    artifact_dir, model_dir, args)`` -> the summary, with the settings named in ``settings``
    recorded beside it. ``model_dir``: the prepared checkpoint, which the deployments serve and
    whose tokenizer the tools use."""
    from build_scripts.prepare_model import ensure_model
    from perf.lib.results import results_dir

    exe = tool.install()
    model_dir = ensure_model(None)

    def start_or_running(mode: str, log_dir: Path) -> tuple[str, Callable[[], None] | None]:
        return (args.url, None) if args.url else start(mode, log_dir, model_dir)

    return run_deployments(
        ["running"] if args.url else args.modes.split(","),
        Path(args.out) if args.out else results_dir() / tool.subdir,
        start_or_running,
        lambda target, artifact_dir: run(exe, target, artifact_dir, model_dir, args),
        f"{tool.title} {tool.version}",
        {k: getattr(args, k) for k in settings},
        tool.rates,
    )
