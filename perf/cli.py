"""``triton-disagg bench SUBCOMMAND [ARGS]``: every benchmark behind one command, each run
recorded in one results envelope (``perf/lib/results.py``: the command, the git commit, the
machine, the wall time, the files it wrote and their figures) under ``perf/runs/``.

Each subcommand is a module of ``perf/`` with ``main(argv)``; ``ARGS`` go to it unchanged
(``triton-disagg bench engine --help`` shows its own). ``triton-disagg bench report`` writes
``perf/REPORT.md`` from the newest successful run of each (``perf/lib/report.py``).
``gpu_check`` and ``soak`` are checks, not benchmarks: ``python -m perf.gpu_check``,
``python -m perf.soak``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import io
import sys
import time

# name -> (module, what it measures); the order is the help's
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("perf.bench_engine", "the engine against transformers: prefill, decode at batch 1 and 16"),
    "formats": ("perf.bench_formats", "weight formats (float32, bfloat16, fp16w, int4w): speed and quality"),
    "spec": ("perf.bench_spec", "speculative decoding: accepted tokens per step, decode tokens/s"),
    "transfer": ("perf.bench_transfer", "page-level NIXL KV transfer against raw bulk NIXL and memcpy"),
    "ttft": ("perf.bench_ttft", "TTFT of a long prompt, layer-by-layer against after-prefill KV streaming"),
    "serve": ("perf.compare_modes", "aggregated against disaggregated serving under Poisson load"),
    "sweep": ("perf.goodput", "goodput under SLOs over a rate sweep, aggregated budgets and disaggregated"),
    "multiturn": ("perf.bench_multiturn", "multi-turn chat: prefix caching, KV-aware routing, KV tiers"),
    "dashboard": ("perf.bench_dashboard", "the Grafana dashboard's panels as PNG charts, from Prometheus under load"),
    "migration": ("perf.bench_migration", "what a client sees when its decode instance dies"),
    "perplexity": ("perf.bench_perplexity", "perplexity on held-out text through the server, per format and mode"),
    "cpp-baseline": ("perf.bench_cpp_baseline", "one stream: our server against llama.cpp's on the same GGUF"),
    "one-stream": ("perf.one_stream", "one stream's decode speed through a running server"),
    "autoscale": ("perf.autoscale_ramp", "the autoscaler on a load ramp against fixed deployments"),
    "plan-check": ("perf.plan_check", "the planner's predictions against measured goodput points"),
    "served-profile": ("perf.served_profile", "calibrate the planner profile's served overheads"),
    "lm-eval": ("perf.lm_eval_run", "lm-eval against the OpenAI API"),
    "genai-perf": ("perf.genai_perf", "NVIDIA genai-perf against the Triton API"),
    "aiperf": ("perf.aiperf", "NVIDIA AIPerf against the OpenAI API"),
    "perf-analyzer": ("perf.perf_analyzer", "NVIDIA perf_analyzer --streaming on the front model"),
}


# benchmark -> the flags that switch it to another measurement: the report keeps a section for each
VARIANTS: dict[str, tuple[str, ...]] = {
    "multiturn": ("--routing", "--tiers", "--modes", "--conversations"),
    "formats": ("--server",),
    "cpp-baseline": ("--weights",),
    "one-stream": ("--tracing",),
}

REPORT_HELP = "perf/REPORT.md from the newest successful run of each benchmark (not a benchmark)"


def parser() -> argparse.ArgumentParser:
    lines = "\n".join(
        f"  {name:<15} {what}" for name, (_, what) in [*SUBCOMMANDS.items(), ("report", ("", REPORT_HELP))]
    )
    p = argparse.ArgumentParser(
        prog="triton-disagg bench",
        description=__doc__,
        epilog=f"subcommands:\n{lines}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("subcommand", choices=list(SUBCOMMANDS), metavar="SUBCOMMAND", help="one of the subcommands below")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the subcommand's own arguments")
    return p


def run(name: str, argv: list[str]) -> int:
    """Run one subcommand and record it; its exit code."""
    from perf.lib import results

    module = importlib.import_module(SUBCOMMANDS[name][0])
    if any(a in ("-h", "--help") for a in argv):
        return _exit_code(module, argv)  # a help text is not a run
    record = results.begin(name, ["triton-disagg", "bench", name, *argv])
    before = results.file_states(results.results_dir())
    since = time.time()
    code = 1
    printed = _Tee(sys.stdout)
    try:
        with contextlib.redirect_stdout(printed):
            code = _exit_code(module, argv)
    finally:
        record.output = printed.tail()
        path = results.finish(record, since, code, before)
        print(f"bench {name}: exit {code}; run recorded in {path}", file=sys.stderr, flush=True)
    return code


class _Tee(io.TextIOBase):
    """What the benchmark prints goes on to the terminal and is kept (its tail) for the envelope."""

    def __init__(self, out, keep: int = 32 << 10):
        self.out, self.keep, self.size = out, keep, 0
        self.parts: collections.deque[str] = collections.deque()

    def write(self, text: str) -> int:
        self.out.write(text)
        self.parts.append(text)
        self.size += len(text)
        while self.size > self.keep and len(self.parts) > 1:
            self.size -= len(self.parts.popleft())
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def tail(self) -> str:
        return "".join(self.parts)[-self.keep :]


def _exit_code(module, argv: list[str]) -> int:
    try:
        out = module.main(argv)
    except SystemExit as e:  # argparse's --help and errors, and modules that exit
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return int(out) if isinstance(out, int) else 0


def report(argv: list[str]) -> int:
    from pathlib import Path

    from perf.lib import report as generated

    p = argparse.ArgumentParser(prog="triton-disagg bench report", description=REPORT_HELP)
    p.add_argument("--runs", type=Path, default=None, help="folder of run envelopes (default perf/runs/)")
    p.add_argument("--out", type=Path, default=generated.REPORT, help="the report to write")
    args = p.parse_args(argv)
    generated.generate(SUBCOMMANDS, args.runs, args.out, VARIANTS)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        return report(argv[1:])
    args = parser().parse_args(argv)
    return run(args.subcommand, list(args.args))


if __name__ == "__main__":
    raise SystemExit(main())
