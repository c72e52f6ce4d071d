"""``perf/lib``'s shared pieces, without a server: the one percentile definition, the arrival
processes (seeded: the same traces as the code they replaced), the open-loop replay, the
progress switch and the external tools' driver options."""

from __future__ import annotations

import argparse
import math
import random

import numpy as np
import pytest

from backend.launch.deployment import core_split
from perf.lib import loadgen, progress, stats, tools


def test_percentile_is_numpys_linear_interpolation_and_nan_for_nothing():
    values = [0.3, 0.1, 0.9, 0.5, 0.7, 0.2]
    for q in (0, 10, 50, 90, 99, 100):
        assert stats.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert stats.median(iter(values)) == pytest.approx(0.4)
    assert math.isnan(stats.percentile([], 50)) and math.isnan(stats.median([]))
    s = stats.summary(values)
    assert s["n"] == 6 and s["max"] == 0.9 and s["mean"] == pytest.approx(sum(values) / 6)
    assert s["p50"] == pytest.approx(0.4) and s["p90"] == pytest.approx(float(np.percentile(values, 90)))
    assert stats.summary([])["n"] == 0 and math.isnan(stats.summary([])["p99"])


def test_decode_rate_counts_the_tokens_after_the_first():
    assert stats.decode_rate([1.0, 1.5, 2.0, 3.0]) == pytest.approx(1.5)
    assert math.isnan(stats.decode_rate([1.0])) and math.isnan(stats.decode_rate([2.0, 2.0]))
    assert stats.gaps([1.0, 1.5, 3.0]) == [0.5, 1.5]


def _old_ramp_trace(phases, prompt_tokens, output_tokens, seed):
    """perf/autoscale_ramp.py's ramp_trace before it moved to perf/lib/loadgen.py."""
    rng = random.Random(seed)
    out, start = [], 0.0
    for ph in phases:
        t = start
        while ph.rate > 0:
            t += rng.expovariate(ph.rate)
            if t >= start + ph.duration_s:
                break
            out.append((t, rng.randint(*prompt_tokens), rng.randint(*output_tokens)))
        start += ph.duration_s
    return out


def test_the_ramp_trace_is_the_one_it_was():
    phases = loadgen.parse_phases("60:0.1,180:0.6,0:5,30:0,210:0.1")
    assert phases[1] == loadgen.Phase(180.0, 0.6)
    trace = loadgen.ramp_trace(phases, (32, 384), (16, 48), seed=1)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace] == _old_ramp_trace(
        phases, (32, 384), (16, 48), 1
    )
    assert len(trace) > 50 and all(not 240 <= r.arrival_s < 270 for r in trace)  # the phase of rate 0


class _CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def _old_plan_offsets(w: loadgen.Workload, tok) -> list[float]:
    """The arrival offsets of perf/loadgen.py's plan_requests before the arrival processes."""
    rng = random.Random(w.seed)
    out, t = [], rng.expovariate(w.rate)
    while (len(out) < w.n_requests) if w.n_requests > 0 else (t < w.duration_s):
        n_in = rng.randint(*w.prompt_tokens)
        loadgen.make_prompt(tok, n_in, rng)
        out.append(t)
        rng.randint(*w.output_tokens)
        t += rng.expovariate(w.rate)
    return out


@pytest.mark.parametrize("n_requests", [0, 7])
def test_planned_poisson_requests_are_the_ones_they_were(n_requests):
    tok = _CharTokenizer()
    w = loadgen.Workload(rate=0.5, duration_s=60.0, prompt_tokens=(8, 16), output_tokens=(2, 4), n_requests=n_requests)
    plan = loadgen.plan_requests(tok, w)
    assert [p[0] for p in plan] == _old_plan_offsets(w, tok)
    assert all(8 <= p[2] <= 16 and 2 <= p[3] <= 4 for p in plan)
    assert len(plan) == 7 if n_requests else all(p[0] < 60.0 for p in plan)


def test_replay_sends_each_request_at_its_offset_in_a_thread_of_its_own():
    sent: dict[int, float] = {}
    t0 = loadgen.replay([0.0, 0.05, 0.1], lambda i, t: sent.__setitem__(i, t), drain_timeout_s=5, desc=None)
    assert sorted(sent) == [0, 1, 2]
    assert sent[2] - t0 >= 0.1 and sent[0] - t0 < 0.05


def test_progress_follows_the_terminal_unless_the_environment_says(monkeypatch):
    monkeypatch.setenv(progress.ENV, "0")
    assert not progress.enabled()
    assert list(progress.bar(range(3), "x")) == [0, 1, 2]
    monkeypatch.setenv(progress.ENV, "1")
    assert progress.enabled()
    monkeypatch.delenv(progress.ENV)
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    assert not progress.enabled()


def test_progress_shown_goes_to_stderr_and_is_erased(monkeypatch, capsys):
    monkeypatch.setenv(progress.ENV, "1")
    with progress.Progress(2, "requests") as p:
        p.update()
        p.note("rate 0.1")
        p.update()
    captured = capsys.readouterr()
    assert captured.out == "" and "requests" in captured.err


def test_the_tools_share_their_options_and_default_folder():
    tool = tools.Tool("aiperf", "aiperf==0.13.0", "AIPerf", "aiperf", "profile_export_aiperf.json", ("goodput",))
    args = tools.parser("doc", tool, "URL").parse_args(["--concurrency", "3"])
    assert args.out is None and args.modes == "aggregated,disagg" and args.requests == 24
    assert tool.version == "0.13.0"
    assert tools.load_options(args) == ["--concurrency", "3", "--request-count", "24", "--warmup-request-count", "2"]
    assert tools.load_options(argparse.Namespace(concurrency=1, requests=4))[:2] == ["--concurrency", "1"]


def test_the_cores_split_between_prefill_and_decode():
    pre, dec, n_pre, n_dec = core_split()
    assert n_pre >= 1 and n_dec >= 1 and len(pre.split(",")) == n_pre and len(dec.split(",")) == n_dec


FAKE_LLAMA_CPP = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_llama_cpp_server_is_ready_when_it_lists_its_models_and_stops():
    import subprocess
    import sys

    from backend.launch.ports import free_port
    from perf.lib.servers import LlamaCppServer

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", FAKE_LLAMA_CPP, str(port)])
    with LlamaCppServer(proc, f"http://127.0.0.1:{port}").wait_ready(timeout_s=30) as server:
        assert server.proc.poll() is None
    assert proc.poll() is not None
    dead = LlamaCppServer(subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]), "http://127.0.0.1:1")
    with pytest.raises(RuntimeError, match="exited with 3"):
        dead.wait_ready(timeout_s=30)


def test_a_tool_being_installed_elsewhere_is_waited_for_not_installed_again(tmp_path, monkeypatch):
    """``ensure_tool`` while another holder (the background installer of ``scripts/test.sh``)
    has the tool's lock: it waits, then finds the install done and runs no pip of its own (the
    venv here has no Python: a pip run would fail)."""
    import fcntl
    import threading
    import time

    monkeypatch.setattr(tools, "ROOT", tmp_path)
    venv = tmp_path / ".venv" / "tools" / "fake"
    (venv / "bin").mkdir(parents=True)
    lock = open(venv.parent / "fake.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)

    def finish_install():
        time.sleep(0.3)
        (venv / "bin" / "fake").write_text("")
        (venv / ".requirement").write_text("fake==1.0")
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()

    t0 = time.monotonic()
    threading.Thread(target=finish_install).start()
    assert tools.ensure_tool("fake", "fake==1.0", "fake") == venv / "bin" / "fake"
    assert time.monotonic() - t0 >= 0.3


def test_a_step_profile_sums_each_ops_own_time_by_class():
    """``perf/lib/step_profile``: a step of one product, one elementwise op and one view: their
    classes get time, the op calls are counted per step, the classes plus the time outside ops
    add up to the step's wall time, and the table has a row per class."""
    import torch

    from perf.lib import step_profile

    a, b = torch.randn(64, 256), torch.randn(256, 256)

    def step():
        return (a @ b).add_(1.0).view(-1)

    r = step_profile.profile_steps(step, 4)
    assert r["ms"]["linear products"] > 0 and r["ms"]["norms, rotary, activations"] > 0, r
    assert r["op_calls"] >= 3, r
    assert sum(r["ms"].values()) >= r["wall_ms"] * 0.999
    assert step_profile.op_class("aten::fbgemm_linear_fp16_weight_fp32_activation") == "linear products"
    assert step_profile.op_class("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert step_profile.op_class("aten::nonexistent") == step_profile.OTHER
    table = step_profile.markdown({"case": r})
    for cls, _ in step_profile.CLASSES:
        assert f"| {cls} | " in table
    assert "| op calls per step |" in table and step_profile.OUTSIDE in table


def test_a_reports_kernel_line_is_the_same_function_on_the_recorded_path():
    """A run records the line (``perf/lib/machine.describe``); one recorded before that gets the
    line written from the path it recorded, and one from before our kernels names none of them."""
    from backend.engine.cpu_kernels import KernelPath, kernel_path
    from backend.engine.formats import kernel_path_line
    from perf.lib.report import kernel_line

    path = kernel_path()
    assert KernelPath.from_dict(path.as_dict()) == path
    assert kernel_line({"kernel_path": path.as_dict()}) == kernel_path_line()
    assert kernel_line({"kernel_path_line": "kernel path: recorded"}) == "kernel path: recorded"
    old = {k: v for k, v in path.as_dict().items() if k not in ("group_kernel", "int4w_path")}
    want = f"kernel path: {path.cpu} ({path.cpu_id}); torch {path.torch_capability}"
    assert kernel_line({"kernel_path": old}) == want
    assert kernel_line({}) is None
