"""Shared fixtures: the real model checkpoint and real Triton servers (stopped by PID)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
import uuid
import weakref
from pathlib import Path

import pytest

from backend.cluster.prometheus_text import metric_values, read_metrics  # noqa: F401  (tests import them from here)
from tests.checkpoint import real_model_dir
from tests.skips import SkipRecord, require_module

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# what the engine saves for later runs (the kernel library, the disk KV tier) stays in this run
os.environ.setdefault("TRITON_DISAGG_CACHE", tempfile.mkdtemp(prefix="triton-disagg-tests-"))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The prepared real checkpoint (tests/checkpoint.py)."""
    return real_model_dir()


@pytest.fixture(scope="session")
def nixl():
    """NIXL (nixl-cu12), a pinned dependency: a test module that needs it says
    ``pytestmark = pytest.mark.usefixtures("nixl")``; missing, its tests skip, or fail in CI."""
    return require_module("nixl_cu12._api", "NIXL (nixl-cu12)")


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def wait_pool_free(url: str, model: str, timeout_s: float = 30.0) -> None:
    """Wait until every instance of ``model`` reports all KV pages free; fail with the figures."""
    deadline = time.monotonic() + timeout_s
    while True:
        total = metric_values(url, "triton_disagg_kv_pages_total", model=model)
        free = metric_values(url, "triton_disagg_kv_pages_free", model=model)
        if total and sum(total) > 0 and sum(total) == sum(free):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV pool of {model} not back to all free: total {total}, free {free}")
        time.sleep(0.2)


def wait_metric(url: str, name: str, at_least: float, timeout_s: float = 15.0, **labels) -> float:
    """Wait until the sum of metric ``name`` (with ``labels``) is at least ``at_least`` (an
    instance refreshes its metrics from a thread of its own, later on a loaded machine); return
    it, or fail with the last value read."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = sum(metric_values(url, name, **labels))
        if value >= at_least:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}{labels} is {value}, not at least {at_least}, after {timeout_s:g} s")
        time.sleep(0.1)


def settled_metric(url: str, name: str, quiet_s: float = 0.6, timeout_s: float = 15.0, **labels) -> float:
    """The sum of counter ``name`` (with ``labels``) once it has stopped moving: two reads
    ``quiet_s`` apart give the same value (an instance refreshes its metrics every 0.25 s from a
    thread of its own, later on a loaded machine, and a prefill's last layers are counted as they
    are posted); fail with the last two values when it still moves after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    value = sum(metric_values(url, name, **labels))
    while True:
        time.sleep(quiet_s)
        last, value = value, sum(metric_values(url, name, **labels))
        if value == last:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}{labels} still moves after {timeout_s:g} s: {last} -> {value}")


@contextlib.contextmanager
def running_server(repo, log_file, timeout_s: float = 400, **kw):
    """A started TritonServer that is stopped (whole process group) however the block ends."""
    from backend.launch.server import TritonServer

    server = TritonServer(repo, log_file=log_file, **kw)
    try:
        server.start(timeout_s=timeout_s)
        yield server
    finally:
        server.stop()
        print(f"tritonserver log: {log_file}")
    assert_no_crash(log_file)


REMOTE_PREFILL = {"local_prefill_max_tokens": "0"}
# float32 weights: the end-to-end tests compare outputs with transformers' float32 (and across
# modes within 1e-4). serve's default, weights_dtype=auto, picks fp16w-bf16 (AMX) or fp16w (AVX2, F16C);
# test_cli.py, test_autoscale_ramp.py and the benchmarks' tests run that default.
EXACT = {"weights_dtype": "float32"}


def etcd_server(tmp: Path, host: str = "127.0.0.1"):
    """A real etcd (not started) for one deployment's membership. etcd is part of the setup
    (``scripts/setup.sh`` installs Debian's etcd-server), so its absence fails the test."""
    from backend.launch.etcd_server import EtcdServer, etcd_binary

    assert etcd_binary() is not None, "etcd is not installed: run scripts/setup.sh as root (Debian's etcd-server)"
    return EtcdServer(host=host, data_dir=tmp / "etcd", log_file=tmp / "etcd.log")


@contextlib.contextmanager
def private_etcd(tmp: Path):
    """A started etcd (:func:`etcd_server`), stopped however the block ends."""
    with etcd_server(tmp) as etcd:
        yield etcd


def fabric_env(secret: dict, device: str | None) -> dict:
    """The environment of a server whose KV fabric runs over UCX TCP on ``device`` (None:
    UCX's choice), with the deployment secret."""
    return {"UCX_TLS": "tcp", **secret} | ({"UCX_NET_DEVICES": device} if device else {})


@contextlib.contextmanager
def deployment_server(tmp_path_factory, name: str, timeout_s: float = 400, **launch_kwargs):
    """A real tritonserver started by the launcher ``serve`` and the benchmarks use
    (``backend/launch/launcher.py``; ``Launch`` arguments, ``model_path`` for its
    ``model_dir``) in a fresh temporary folder, stopped however the block ends. A disaggregated
    deployment gets a private etcd for its membership (``server.etcd``) and a deployment
    secret, as ``triton-disagg serve`` does. Its cores are shared (several instances per role on
    2 cores), not split between the roles as ``serve`` does."""
    from backend.launch.launcher import Launch, stop

    tmp = tmp_path_factory.mktemp(name)
    # every prefill crosses the fabric unless a test asks otherwise (test_conditional_disagg.py):
    # the tests of the disaggregated path must not be answered by a local prefill; float32 weights
    # unless a test names a format (EXACT)
    # unless a test names one, a disk KV tier of the deployment's own (no blocks shared between tests)
    launch_kwargs["overrides"] = {
        **REMOTE_PREFILL,
        **EXACT,
        "kv_disk_path": str(tmp / "kv"),
        **(launch_kwargs.get("overrides") or {}),
    }
    launch_kwargs["model_dir"] = launch_kwargs.pop("model_path", "")
    log_file = tmp / "tritonserver.log"
    launch = Launch(repo_dir=tmp / "repo", log_file=log_file, timeout_s=timeout_s, placement="shared", **launch_kwargs)
    server, _ = launch.start()
    try:
        yield server
    finally:
        stop(server)
        print(f"tritonserver log: {log_file}")
    assert_no_crash(log_file)


def assert_no_crash(log_file: Path) -> None:
    """A server that stopped: no Python-backend stub crashed in its log (until stop 60 the front
    model's stub died at every shutdown: its metric families were destroyed after the stub's
    shared memory, "Fatal Python error: Segmentation fault ... Garbage-collecting")."""
    text = Path(log_file).read_text(errors="replace") if Path(log_file).exists() else ""
    at = text.find("Fatal Python error")
    assert at < 0, f"a stub crashed in {log_file}:\n{text[max(0, at - 1500) : at + 1500]}"


@pytest.fixture(scope="session")
def aggregated_server(model_dir, tmp_path_factory):
    """A real tritonserver with the aggregated ``llm`` model, small limits for the fault tests."""
    with deployment_server(
        tmp_path_factory,
        "agg",
        timeout_s=300,
        mode="aggregated",
        model_path=str(model_dir),
        overrides={
            "kv_cache_tokens": "4096",
            "max_tokens_limit": "256",
            "max_queue_size": "16",
            "max_num_batched_tokens": "128",
            "num_threads": "2",
            "max_grammar_compile_s": "1",
        },
    ) as server:
        yield server


# Prompts shared by the end-to-end tests: varied lengths; the last two are long enough for
# several prefill chunks at a 64-token budget.
PROMPTS = [
    "What is the capital of France?",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three fruits:",
    "The theory of relativity says that",
    "Translate to French: I like apples.",
    "Summarize: " + "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 16,
    "Read the text and answer. "
    + " ".join(f"Item {i} costs {i * 3} dollars." for i in range(40))
    + " Which item is the most expensive?",
]

DISAGG_MODELS = ["prefill_0", "prefill_1", "decode_0", "decode_1", "decode_2", "llm_aggregated"]


@pytest.fixture(scope="session")
def disagg_server(model_dir, tmp_path_factory):
    """One tritonserver with 2 prefill + 3 decode instances, the front ``llm`` (routing to
    decode_0 and decode_1), and ``llm_aggregated``. decode_2 has a tiny pool for overload tests."""
    with deployment_server(
        tmp_path_factory,
        "disagg",
        timeout_s=400,
        mode="disagg",
        model_path=str(model_dir),
        prefill_instances=2,
        decode_instances=3,
        with_aggregated=True,
        overrides={
            "kv_cache_tokens": "4096",
            "max_num_batched_tokens": "64",
            "max_tokens_limit": "256",
            "num_threads": "1",
            "kv_transfer_timeout_s": "15",
            "kv_quarantine_s": "4",
            "kv_xfer_timeout_s": "3",
        },
        per_model={
            "front": {"decode_models": "decode_0,decode_1"},
            "decode_2": {"kv_cache_tokens": "512", "max_waiting_for_pages": "1", "page_wait_timeout_s": "4"},
        },
    ) as server:
        yield server


@pytest.fixture(scope="session")
def hf_model():
    """The reference: transformers' float32 model of the checkpoint (one for the session; not
    through the ``model_dir`` fixture, which a module may narrow to its own scope)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(real_model_dir()), dtype=torch.float32).eval()


_greedy_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {prompt ids: tokens}


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Reference: n greedy tokens from transformers (its own forward and KV cache, one token a
    step), EOS not special. Kept for the session per model and prompt: the first n tokens of a
    longer greedy run from the same start are those of the shorter one (the same steps), so a
    prompt that several tests check is computed once, at the longest length asked so far."""
    from backend.engine.reference import hf_greedy as greedy_on

    memo = _greedy_memo.setdefault(model, {})
    known = memo.get(tuple(ids))
    if known is None or len(known) < n:
        known = memo[tuple(ids)] = greedy_on(model, ids, n, "cpu")
    return known[:n]


def generate_concurrently(url: str, prompts: list[str], model: str, n_tokens: int, **kw) -> list:
    """One streamed greedy request per prompt, all in flight at once; results in prompt order."""
    import threading

    from backend.client import stream_generate

    out = [None] * len(prompts)

    def run(i):
        out[i] = stream_generate(url, prompts[i], n_tokens, model=model, ignore_eos=True, **kw)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join(300) for t in threads]
    return out


def kernel_path_header() -> list[str]:
    """The CPU, what ``TRITON_DISAGG_CPU`` masks and the kernel path, first in every run: a result
    that depends on the path is asserted for the path named here."""
    from backend.engine.cpu_kernels import kernel_path
    from backend.engine.formats import kernel_path_line

    path = kernel_path()
    return [f"cpu isa: {' '.join(path.isa) or '(no AVX2)'}", path.mask_line, kernel_path_line()]


def pytest_configure(config):
    """A run masked as an AVX2-only CPU whose torch dispatches wider is refused, with the reason."""
    from backend.engine.cpu_kernels import kernel_path, mask_mismatch

    if mask_mismatch(kernel_path()):
        raise pytest.UsageError(mask_mismatch(kernel_path()))


def pytest_report_header(config):
    return kernel_path_header()


def pytest_sessionstart(session):
    """Under ``-q`` (scripts/test.sh, CI) pytest prints no header: the kernel path is printed anyway."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and reporter.verbosity < 0:
        for line in kernel_path_header():
            reporter.write_line(line)


STUB = "triton_python_backend_stub"
_reaped: list[str] = []


def orphaned_stubs() -> list:
    """Python-backend stubs whose tritonserver is gone (a test killed it, or it aborted): they
    are reparented, not ended, and a stub blocked in Triton's C++ keeps the GIL and can spin, so
    later tests would share the CPU with it. ``serve`` kills them with the dead server's process
    group when it restarts it; a test's server has no such supervisor."""
    import psutil

    out = []
    for p in psutil.process_iter(["name", "ppid"]):
        try:
            if STUB not in (p.info["name"] or "") and not any(STUB in a for a in p.cmdline()[:1]):
                continue
            parent = psutil.Process(p.info["ppid"]) if p.info["ppid"] else None
            if parent is None or "tritonserver" not in parent.name():
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


@pytest.fixture(autouse=True)
def _reap_orphaned_stubs(request):
    """After each integration test, SIGKILL the stubs its dead servers left (named at the end of
    the run, with the test that left them)."""
    yield
    if "integration" not in request.node.path.parts:
        return
    import psutil

    orphans = orphaned_stubs()
    for p in orphans:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    if orphans:
        _reaped.append(f"{request.node.nodeid}: {len(orphans)} (pids {', '.join(str(p.pid) for p in orphans)})")


def pytest_terminal_summary(terminalreporter):
    _skips.write(terminalreporter)
    if _reaped:
        terminalreporter.section("orphaned python-backend stubs reaped after")
        for line in _reaped:
            terminalreporter.write_line(line)


_skips = SkipRecord()


def pytest_runtest_logreport(report):
    _skips.add(report)


def pytest_collectreport(report):
    _skips.add(report)  # a module skipped as a whole


def pytest_sessionfinish(session):
    """A CI run fails on a skip that tests/skips.py does not allow (each is listed at the end)."""
    if _skips.fails_run() and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# Run last among the integration tests: the benchmarks' tiny cases, whose external tools
# (llama.cpp's server compiles for minutes on 2 cores) ``scripts/test.sh`` installs meanwhile in
# the CPU time the other tests leave idle; run second (their file's place by name), a case that
# needs a tool waited for its install with the whole machine.
LAST_INTEGRATION = "test_bench_subcommands.py"


def pytest_collection_modifyitems(config, items):
    """Mark each test by its folder: ``unit`` (no server, no peer process) or ``integration``;
    order: the integration tests (the benchmarks' last, :data:`LAST_INTEGRATION`), then the
    unit tests, each file's tests in their order."""
    for item in items:
        parts = item.path.parts
        if "unit" in parts:
            item.add_marker(pytest.mark.unit)
        elif "integration" in parts:
            item.add_marker(pytest.mark.integration)
    items.sort(key=lambda item: ("unit" in item.path.parts, item.path.name == LAST_INTEGRATION))


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def two_hosts():
    """Yield (prefill_ip, prefill_netns, prefill_dev, decode_ip, decode_dev), or loopback when netns can't be made."""
    tag = uuid.uuid4().hex[:6]
    ns, dev_root, dev_ns = f"tdis-{tag}", f"tdr{tag}", f"tdn{tag}"
    octet = int(tag[:2], 16) % 200 + 20
    ip_ns, ip_root = f"10.{octet}.77.1", f"10.{octet}.77.2"
    try:
        _ip("netns", "add", ns)
    except (OSError, subprocess.CalledProcessError) as e:
        reason = getattr(e, "stderr", None) or str(e)
        print(f"network namespaces unavailable ({reason.strip()}); running both servers on loopback")
        yield ("127.0.0.1", None, None, "127.0.0.1", None)
        return
    try:
        _ip("link", "add", dev_root, "type", "veth", "peer", "name", dev_ns)
        _ip("link", "set", dev_ns, "netns", ns)
        _ip("addr", "add", f"{ip_root}/24", "dev", dev_root)
        _ip("link", "set", dev_root, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{ip_ns}/24", "dev", dev_ns)
        _ip("netns", "exec", ns, "ip", "link", "set", dev_ns, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        print(f"prefill host: netns {ns} at {ip_ns} ({dev_ns}); decode host: root namespace at {ip_root} ({dev_root})")
        yield (ip_ns, ns, dev_ns, ip_root, dev_root)
    finally:
        _ip("link", "del", dev_root, check=False)
        _ip("netns", "del", ns, check=False)
