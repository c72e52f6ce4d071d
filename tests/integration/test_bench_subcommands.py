"""Every ``triton-disagg bench`` subcommand runs on a tiny setting (issue 28: "CI runs each
subcommand on a tiny setting"), the way a user runs it: ``python -m backend.cli bench NAME ARGS``
in its own process (module state and environment stay out of this one), on the real model, real
``tritonserver`` deployments, NIXL between prefill and decode instances, and the real external
tools (genai-perf, AIPerf, lm-eval, perf_analyzer, llama.cpp; installed on first use under
``.venv/tools/``).

The results folder is a temporary one (``TRITON_DISAGG_RESULTS``), so nothing lands in
``perf/results/`` or the tracked ``perf/runs/``. Each run must exit 0 and leave exactly one
envelope for its subcommand, exit code 0, with the commit and the machine, whose figures (the
JSON the benchmark wrote) hold its key numbers, finite and positive.

The settings are the smallest that still go through each benchmark's real path: one repeat,
a few tokens, seconds of load, one round. ``plan-check`` checks the points of the tiny ``sweep``
(one run of it serves both tests) against the committed profile ``perf/report/profile_fp32.json``,
which ``served-profile`` calibrates too."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "perf" / "report" / "profile_fp32.json"
HELDOUT = ROOT / "perf" / "data" / "heldout_en.txt"

# cpp-baseline builds llama.cpp on first use (about 8 minutes on 2 cores)
pytestmark = pytest.mark.timeout(1500)

# name -> its tiny arguments; "{key}" is filled in from PLACEHOLDERS when the case runs.
# The order is the run order: cpp-baseline (which installs llama.cpp) before perplexity.
TINY: dict[str, list[str]] = {
    "transfer": ["--reps", "1", "--tokens", "256", "--layers", "4"],
    "spec": ["--max-tokens", "16", "--repeats", "1", "--decoders", "transformers,auto"],
    "engine": ["--repeats", "1", "--decode-tokens", "4", "--profile-formats", "float32,fp16w", "--profile-steps", "4"],
    "formats": ["--formats", "float32,fp16w", "--decoders", "auto", "--windows", "1", "--greedy-tokens", "8"],
    # 32 tokens: the two concurrent streams must still be decoding together once the second's
    # prefill is done (8 tokens of a fused int4w decode ended before it, 2026-12-05)
    # 128 tokens: the two streams' prefills queue on the one prefill instance, and at 32 tokens the
    # first stream (~0.2 s of decode) could end before the second's first token (CI, 2026-12-06)
    "one-stream": ["--tokens", "128", "--streams", "1", "--modes", "disagg", "--concurrency", "2"],
    "ttft": ["--prompt-tokens", "64", "--repeats", "1"],
    "serve": ["--rate", "1", "--duration", "4", "--low-rate", "0", "--prompt-tokens", "32", "64"]
    + ["--output-tokens", "4", "8"],
    "sweep": ["--deployments", "agg128,disagg", "--rates", "1", "--requests", "3", "--unloaded-requests", "1"]
    + ["--prompt-tokens", "32", "64", "--output-tokens", "4", "8", "--drain", "60"],
    "plan-check": ["--goodput", "{goodput}", "--profile", str(PROFILE), "--out", "{results}/plan_check.md"],
    "served-profile": ["--profile", str(PROFILE), "--out", "{results}/served_profile.json"]
    + ["--prompt-tokens", "64", "--ttft-requests", "1"],
    "multiturn": ["--modes", "disagg", "--conversations", "2", "--turns", "2", "--system-tokens", "64"]
    + ["--user-tokens", "8", "--output-tokens", "4", "--think-s", "0"],
    "dashboard": ["--phases", "12:0.5", "--prompt-tokens", "16", "--output-tokens", "4", "--step-s", "5"],
    "migration": ["--rounds", "1", "--seconds", "6", "--kill-every", "3", "--log-dir", "{results}/migration-logs"],
    "autoscale": ["--phases", "12:0.5", "--fixed", "", "--max-prefill", "1", "--max-decode", "1"]
    + ["--prompt-tokens", "16", "32", "--output-tokens", "4", "8"],
    "cpp-baseline": ["--rounds", "1", "--streams", "1", "--tokens", "16"],
    "perplexity": ["--formats", "float32", "--modes", "aggregated", "--text", "{text}", "--window", "64"]
    + ["--tokens", "8", "--streams", "1"],
    # two requests a window spread widely on a shared 2-core machine: a wide stability band
    "perf-analyzer": ["--url", "{grpc_url}", "--concurrency", "1", "--max-tokens", "4", "--requests-per-window", "2"]
    + ["--stability-percentage", "100", "--max-trials", "10"],
    "genai-perf": ["--url", "{grpc_url}", "--requests", "2", "--concurrency", "1", "--isl", "16", "--osl", "4"],
    "aiperf": ["--url", "{openai_url}", "--requests", "2", "--concurrency", "1", "--isl", "16", "--osl", "4"]
    + ["--slo-ttft-ms", "60000", "--slo-itl-ms", "60000"],
    "lm-eval": ["--url", "{openai_url}", "--limit", "1"],  # its exports land in the results folder
}


@dataclass
class Run:
    """One finished ``bench`` run: its results folder, what it printed, its envelope."""

    name: str
    results: Path
    stdout: str
    envelope: dict

    def figure(self, pattern: str) -> dict:
        """The figures of the one result file whose name matches ``pattern``."""
        found = {k: v for k, v in self.envelope["figures"].items() if fnmatch.fnmatch(Path(k).name, pattern)}
        assert len(found) == 1, f"{self.name}: one figures file {pattern!r} expected: {list(self.envelope['figures'])}"
        return next(iter(found.values()))

    def markdown(self, pattern: str) -> str:
        found = [v for k, v in self.envelope["markdown"].items() if fnmatch.fnmatch(Path(k).name, pattern)]
        assert len(found) == 1, (
            f"{self.name}: one markdown file {pattern!r} expected: {list(self.envelope['markdown'])}"
        )
        return found[0]


def bench(name: str, argv: list[str], results: Path, timeout_s: float = 1400) -> Run:
    """``python -m backend.cli bench NAME ARGV`` with its results folder ``results``; the run,
    after checking its exit code and its one envelope."""
    results.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TRITON_DISAGG_RESULTS": str(results),
        "TRITON_DISAGG_RUNS": str(results / "runs"),
    }
    log = results.parent / f"{name}.log"
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", "bench", name, *argv],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a timeout stops the benchmark and the servers it started
        )
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"bench {name} ran past {timeout_s:.0f} s:\n{log.read_text()[-4000:]}") from None
    stdout = log.read_text()
    print(f"bench {name} {' '.join(argv)}: exit {code} in {time.monotonic() - t0:.1f} s (log {log})")
    assert code == 0, f"bench {name} exited {code}:\n{stdout[-6000:]}"
    envelopes = sorted((results / "runs").glob(f"{name}-[0-9]*.json"))
    assert len(envelopes) == 1, f"one envelope of {name} expected under {results / 'runs'}: {envelopes}"
    envelope = json.loads(envelopes[0].read_text())
    assert envelope["benchmark"] == name and envelope["exit_code"] == 0, envelope
    assert envelope["command"] == ["triton-disagg", "bench", name, *argv]
    assert envelope["commit"] and (len(envelope["commit"]) >= 40 or envelope["commit"] == "unknown")
    machine = envelope["machine"]
    assert machine["cpu"] and machine["cores"] >= 1 and machine["torch"], machine
    assert envelope["seconds"] > 0
    return Run(name, results, stdout, envelope)


def positive(*values) -> None:
    """Every value a finite number above 0."""
    for v in values:
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, values


# --- what a case needs from outside: servers, the sweep's results, a short text ---


@pytest.fixture(scope="module")
def openai_url(aggregated_server, model_dir, tmp_path_factory):
    """The OpenAI frontend in front of the session's aggregated server."""
    from backend.launch.openai_frontend import OpenAIFrontend

    frontend = OpenAIFrontend(
        aggregated_server.grpc_url, model_dir, log_file=tmp_path_factory.mktemp("bench-openai") / "openai.log"
    )
    frontend.start()
    try:
        yield frontend.url
    finally:
        frontend.stop()


@pytest.fixture(scope="module")
def sweep_run(model_dir, tmp_path_factory) -> Run:
    """The tiny ``sweep``, run once: checked by its own case, replayed by ``plan-check``."""
    return bench("sweep", TINY["sweep"], tmp_path_factory.mktemp("bench-sweep") / "results")


PLACEHOLDERS = {
    "results": lambda request, results: str(results),
    "grpc_url": lambda request, results: request.getfixturevalue("aggregated_server").grpc_url,
    "openai_url": lambda request, results: request.getfixturevalue("openai_url"),
    "goodput": lambda request, results: next(
        str(p) for p in request.getfixturevalue("sweep_run").results.glob("goodput_*.json")
    ),
    "text": lambda request, results: str(_short_text(results.parent / "heldout_short.txt")),
}


def _short_text(path: Path) -> Path:
    """The first ~1500 characters of the held-out text (about 330 tokens: 6 windows of 64)."""
    text = HELDOUT.read_text()[:1500]
    path.write_text(text[: text.rfind(" ")] + "\n")
    return path


def _argv(name: str, request, results: Path) -> list[str]:
    out = []
    for a in TINY[name]:
        for key in re.findall(r"\{(\w+)\}", a):
            a = a.replace("{" + key + "}", PLACEHOLDERS[key](request, results))
        out.append(a)
    return out


# --- each subcommand's key figures ---

CHECKS = {}


def check(name: str):
    def register(fn):
        CHECKS[name] = fn
        return fn

    return register


@check("transfer")
def _transfer(run: Run) -> None:
    r = run.figure("bench_transfer_*.json")
    shape = r["shape"]
    assert shape["layers"] == 4 and shape["tokens"] == 256
    assert r["writes"] == shape["layers"] * shape["pages_per_layer"] and r["xfers"] == shape["layers"]
    assert r["bytes"] == r["writes"] * shape["page_bytes"]
    for way in ("page_scattered", "page_contiguous", "page_fresh_alloc", "page_churned_alloc", "raw_bulk", "memcpy"):
        positive(r["median"][way]["transfer_s"], r["median"][way]["bw_vs_raw_bulk"])
    assert r["ucx_protocols"], "the UCX_PROTO_INFO probe reported nothing"


@check("spec")
def _spec(run: Run) -> None:
    figure = run.figure("bench_spec_*.json")
    assert set(figure["by_decoder"]) == {"transformers", "auto"} and figure["results"] == figure["by_decoder"]["auto"]
    for decoder, r in figure["by_decoder"].items():
        assert set(r) == {"lookup_friendly", "no_lookup", "rejected_drafts"}
        for name, w in r.items():
            assert w["identical"], f"{decoder} {name}: speculative output differs from plain greedy"
            positive(w["tok_s_off"], w["tok_s_on"], w["tokens_per_step"])
        assert r["lookup_friendly"]["accepted_per_step"] > 0, f"{decoder}: no lookup draft accepted on copy prompts"
        assert r["rejected_drafts"]["accepted_per_step"] == 0
    assert "| transformers | lookup_friendly |" in run.stdout and "| auto | lookup_friendly |" in run.stdout


@check("engine")
def _engine(run: Run) -> None:
    r = run.figure("bench_engine_*.json")["results"]
    for name in ("prefill", "decode_b1", "decode_b16"):
        positive(r[name]["ours_tok_s"], r[name]["hf_tok_s"], r[name]["ratio"])
    positive(r["decode_b16"]["hf_batch16_tok_s"])
    profile = run.figure("bench_engine_*.json")["step_profile"]
    assert set(profile) == {f"{f}, {s}" for f in ("float32", "fp16w") for s in ("decode b1", "prefill 256")}, profile
    for step, row in profile.items():
        # a decode step's products (the fused step) run in our kernel library; a prefill's in torch's
        products = "our kernel library" if step.endswith("decode b1") else "linear products"
        positive(row["wall_ms"], row["op_calls"], row["ms"][products])
    assert "| linear products | " in run.stdout and "| op calls per step |" in run.stdout  # the table printed


@check("formats")
def _formats(run: Run) -> None:
    r = run.figure("formats.json")["results"]
    f32, fp16w = r["float32, lean loop"], r["fp16w, lean loop"]
    for row in (f32, fp16w):
        positive(row["prefill_tok_s"], row["decode_b1_tok_s"], row["decode_b16_tok_s"], row["heldout_ppl_prefill"])
    assert f32["identical_greedy_share"] == 1.0 and f32["heldout_ppl_ratio_prefill"] == 1.0  # the reference
    assert 0.99 < fp16w["heldout_ppl_ratio_prefill"] < 1.01, fp16w  # formats.FORMATS["fp16w"].quality: 1.001x
    assert fp16w["heldout_argmax_agree_prefill"] > 0.9, fp16w
    assert "formats.md" in " ".join(run.envelope["markdown"])


@check("one-stream")
def _one_stream(run: Run) -> None:
    r = run.figure("one_stream_*.json")
    s = r["summary"]["disagg"]
    assert len(s["tok_s"]) == 1 and r["args"]["tokens"] == 128, r
    positive(s["tok_s_median"], s["tok_s_best"], s["ttft_median"], s["itl_p50_s"])
    c = s["concurrent"]
    assert c["streams"] == 2 and c["gaps_counted"] > 0, c
    positive(c["itl_p50_s"], c["itl_ratio_to_one_stream"])


@check("ttft")
def _ttft(run: Run) -> None:
    r = run.figure("bench_ttft_*.json")["runs"]
    assert set(r) == {"aggregated", "aggregated_prefill_cores", "disagg_layerwise", "disagg_after_prefill"}
    for row in r.values():
        positive(row["ttft_p50_s"])
        assert row["n_prompt_tokens"] == 64, row
    for name in ("disagg_layerwise", "disagg_after_prefill"):
        # what the benchmark measures: the prompt's KV crossed the fabric from the prefill instance
        # (not a prompt the decode instance's prefix cache already holds from the warm-up)
        row = r[name]
        assert row["writes_per_request"] > 0 and row["bytes_per_request"] > 0, (name, row)
        positive(row["prefill_compute_s"])


@check("serve")
def _serve(run: Run) -> None:
    stats = run.figure("compare_*.json")["stats"]
    for mode in ("aggregated", "disagg"):
        s = stats[mode]
        assert s["requests"] >= 1 and s["completed"] == s["requests"] and not s["errors"], s
        positive(s["decode_tps_p50"], s["itl_p50"], s["itl_p99"], s["ttft_p50"], s["req_per_s"])
    assert len([f for f in run.envelope["files"] if f.endswith(".png")]) == 2, run.envelope["files"]
    assert "(b)/(a)" in run.markdown("report_*.md")


@check("sweep")
def _sweep(run: Run) -> None:
    g = run.figure("goodput_*.json")
    positive(g["slo"]["ttft"], g["slo"]["tight_itl"], g["slo"]["loose_itl"])
    assert set(g["results"]) == {"agg128", "disagg"}
    for name, res in g["results"].items():
        positive(res["unloaded"]["ttft"], res["unloaded"]["itl"])
        (point,) = res["points"].values()
        assert len(point["records"]) == 3, point
        for rec in point["records"]:
            assert rec["error"] is None and rec["n_tokens"] == rec["max_tokens"], (name, rec)
            positive(rec["ttft"])
    traces = [f for f in run.envelope["files"] if Path(f).name.startswith("trace_")]
    assert len(traces) == 2, run.envelope["files"]
    assert "goodput" in run.markdown("goodput_*.md")


@check("plan-check")
def _plan_check(run: Run) -> None:
    table = run.markdown("plan_check.md")
    rows = re.findall(
        r"^\| (agg128|disagg) \| 1\.0 \| ([0-9.]+) / ([0-9.]+) \| [0-9.]+ \| ([0-9]+) / ([0-9]+) \|", table, re.M
    )
    assert {r[0] for r in rows} == {"agg128", "disagg"}, table
    for _, *numbers in rows:  # TTFT p50 and ITL p90, measured and predicted
        positive(*(float(x) for x in numbers))
    assert re.search(r"\d+ of 4 predictions within", table), table


@check("served-profile")
def _served_profile(run: Run) -> None:
    from backend.engine.step_profile import EngineProfile

    measured = run.figure("served_profile.measured.json")
    for mode in ("aggregated", "disagg"):
        assert set(measured[mode]["itl"]) == {"1", "2", "4", "8"}, measured
        positive(*measured[mode]["itl"].values(), measured[mode]["ttft"])
    prof = EngineProfile.load(run.results / "served_profile.json")
    assert set(prof.served_overhead_s) == {1, 2}, prof.served_overhead_s  # the cores; the decode instance's
    assert prof.request_overhead_s >= 0 and prof.handoff_s >= 0
    assert "| streams | aggregated served | engine step |" in run.stdout and "| KV handoff (ms) |" in run.stdout


@check("multiturn")
def _multiturn(run: Run) -> None:
    r = run.figure("multiturn.json")["results"]
    off, on = r["disagg, caching off"], r["disagg, caching on"]
    for row in (off, on):
        assert row["requests"] == 2 * 2 and not row["errors"], row
        positive(row["ttft_turn1_p50_s"], row["ttft_later_p50_s"], row["requests_per_s"], row["kv_bytes_per_request"])
    assert off["prefix_hit_tokens"] == 0 and on["prefix_hit_tokens"] > 0, (off, on)


@check("dashboard")
def _dashboard(run: Run) -> None:
    r = run.figure("dashboard.json")
    assert r["requests"] >= 1 and not r["errors"], r
    panels = {d["panel"]: d for d in r["panels"]}
    assert len(panels) >= 12 and all((run.results / d["file"]).stat().st_size > 0 for d in panels.values())
    # the request and latency panels have data after a load (the autoscaler's do not: none runs here)
    assert panels["Requests/s and goodput (TTFT within 2.5 s)"]["series"] >= 1, panels
    assert panels["Queues: requests active, waiting for KV, prefill queue"]["series"] >= 1, panels
    assert "dashboard_1.png" in run.markdown("dashboard.md")


@check("migration")
def _migration(run: Run) -> None:
    r = run.figure("migration.json")
    on, off = r["migration_on"], r["migration_off"]
    assert on["gap"]["streams_failed"] == 0 and on["gap"]["streams_moved"] >= 1, on["gap"]
    assert on["gap"]["streams_on_killed_instance"] >= 1 and off["gap"]["streams_on_killed_instance"] >= 1
    positive(on["gap"]["gap_max_s"], on["gap"]["gap_p50_s"], on["gap"]["inter_token_median_s"])
    assert off["gap"]["streams_failed"] >= 1, off["gap"]  # without migration the victim's streams fail
    assert on["goodput"]["kills"] >= 1 and on["goodput"]["ok"] == on["goodput"]["requests"] >= 1, on["goodput"]
    positive(on["goodput"]["goodput_req_s"], on["goodput"]["goodput_tokens_s"])
    assert off["goodput"]["requests"] >= 1 and off["goodput"]["kills"] >= 1, off["goodput"]
    assert "| | migration on | migration off |" in run.stdout and "| goodput ratio |" in run.stdout  # the table


@check("autoscale")
def _autoscale(run: Run) -> None:
    r = run.figure("autoscale-ramp-*.json")
    (a,) = r["runs"]
    assert a["name"] == "autoscaled" and a["requests"] == r["requests"] >= 1, a
    assert a["failed"] == 0, a["errors"]
    assert 0 <= a["attainment"] <= 1
    positive(a["ttft_p50_s"], a["itl_p90_s"], a["instance_seconds"])
    assert a["mean_instances"] >= 2 - 1e-9, a  # one prefill and one decode instance all along
    assert "| autoscaled | " in run.stdout and "|---|---|---|---|---|---|---|---|" in run.stdout  # the table


@check("cpp-baseline")
def _cpp_baseline(run: Run) -> None:
    r = run.figure("cpp_baseline_*.json")
    (rnd,) = r["rounds"]
    positive(rnd["ours"]["tok_s_median"], rnd["ours"]["itl_p50_ms"], rnd["llama_cpp"]["tok_s_median"])
    assert rnd["llama_cpp"]["tokens_streamed"] == 16, rnd
    positive(r["median_ratio"])


@check("perplexity")
def _perplexity(run: Run) -> None:
    rows = run.figure("perplexity-*.json")["rows"]
    assert not [r for r in rows if r.get("error")], rows
    ours = next(r for r in rows if r["server"] == "triton-disagg" and r["context"] == "window")
    bos = next(r for r in rows if r["server"] == "triton-disagg" and r["context"] != "window")
    cpp = next(r for r in rows if r["server"].startswith("llama.cpp"))
    for r in (ours, bos, cpp):
        assert r["windows"] == 6 and r["scored_tokens"] > 300, r
        assert 1 < r["ppl"] < 1000, r  # English prose: far from uniform over 49k tokens
    positive(ours["decode"]["tok_s_median"], cpp["decode"]["tok_s_median"])
    # the same weights (our checkpoint is prepared from this GGUF), the same context
    assert abs(cpp["ppl"] / bos["ppl"] - 1) < 0.05, (cpp["ppl"], bos["ppl"])
    assert cpp["agree"] > 0.8 and cpp["tokens_equal_ours"] == 1.0, cpp


@check("perf-analyzer")
def _perf_analyzer(run: Run) -> None:
    (row,) = run.figure("perf_analyzer_*.json")["rows"]
    assert row["Concurrency"] == 1
    positive(row["Inferences/Second"], row["p50 latency"], row["p90 latency"])
    assert any(f.endswith(".csv") for f in run.envelope["files"]), run.envelope["files"]
    assert "| concurrency | requests/s | responses/s |" in run.stdout and "\n| 1 | " in run.stdout  # the table


def _tool_summary(run: Run, pattern: str) -> dict:
    summary = run.figure(pattern)
    (result,) = summary["results"].values()
    assert "error" not in result, result
    positive(result["time_to_first_token"]["p50"], result["inter_token_latency"]["p50"])
    positive(result["request_latency"]["p50"], result["output_token_throughput"]["avg"])
    positive(result["request_throughput"]["avg"])
    return result


@check("genai-perf")
def _genai_perf(run: Run) -> None:
    _tool_summary(run, "summary.json")
    assert any("genai_perf" in f and f.endswith("profile_export_genai_perf.json") for f in run.envelope["files"])


@check("aiperf")
def _aiperf(run: Run) -> None:
    result = _tool_summary(run, "summary.json")
    positive(result["goodput"]["avg"])  # SLOs of a minute: every request attains them
    assert any("aiperf" in f and f.endswith("profile_export_aiperf.json") for f in run.envelope["files"])


@check("lm-eval")
def _lm_eval(run: Run) -> None:
    r = run.figure("results_*.json")["results"]
    assert 0 <= r["td_mc"]["acc,none"] <= 1, r["td_mc"]
    assert 1 < r["td_ppl"]["word_perplexity,none"] < 1000 and 1 < r["td_ppl"]["byte_perplexity,none"] < 4, r["td_ppl"]
    assert "exact_match,strip" in r["td_gen"], r["td_gen"]


def listed_subcommands() -> set[str]:
    """The benchmarks ``triton-disagg bench --help`` lists (``report`` is not one)."""
    out = subprocess.run(
        [sys.executable, "-m", "backend.cli", "bench", "--help"], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    listed = out.split("subcommands:\n", 1)[1].splitlines()
    return {line.split()[0] for line in listed if line.startswith("  ")} - {"report"}


def test_every_subcommand_has_a_tiny_case():
    assert set(TINY) == listed_subcommands() == set(CHECKS)


@pytest.mark.parametrize("name", list(TINY))
def test_bench_subcommand_on_a_tiny_setting(name, request, model_dir, tmp_path):
    # model_dir: the checkpoint is prepared once here, not by each benchmark process
    if name == "sweep":
        run = request.getfixturevalue("sweep_run")
    else:
        results = tmp_path / "results"
        run = bench(name, _argv(name, request, results), results)
    CHECKS[name](run)
