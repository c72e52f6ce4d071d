"""The servers the benchmarks start: our deployments, on one machine split between roles, and
llama.cpp's server as a baseline.

Ours (``start``; ``started`` for a ``with`` block): started by the one launcher ``serve`` uses
(``backend/launch/launcher.py``), so the benchmarks measure what ``serve`` runs: aggregated,
``llm`` gets every core; disaggregated (1 prefill + N decode), the launcher's core placement
(the prefill instance pinned to the first half of the cores, the decode instances to the rest),
a private etcd for the membership, the front routing across it; each deployment's disk KV tier
in an empty folder of its own (``kv-MODE`` in its log folder) unless the benchmark names one, so
no run finds the blocks of an earlier one.

llama.cpp's (``start_llama_cpp``): ``llama-cpp-python[server]``, installed on first use into
``.venv/tools/llama-cpp`` (it compiles llama.cpp: minutes), serving a GGUF on the OpenAI API.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perf.lib.tools import ensure_tool

if TYPE_CHECKING:
    from backend.launch.openai_frontend import OpenAIFrontend
    from backend.launch.server import TritonServer

LLAMA_CPP = "llama-cpp-python[server]==0.3.36"
LLAMA_CPP_EOS = "2"  # <|im_end|>, the checkpoint's end of sequence, as a logit-bias key


def _launch(
    mode: str,
    *,
    model: str | None = None,
    overrides: dict | None = None,
    per_model: dict | None = None,
    log_dir: Path | None = None,
    decode_instances: int = 1,
    extra_env: dict | None = None,
    openai: bool = False,
    prometheus: bool = False,
) -> tuple[TritonServer, OpenAIFrontend | None]:
    from backend.launch.launcher import Launch
    from build_scripts.prepare_model import ensure_model

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="triton-disagg-perf-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    overrides = dict(overrides or {})
    if "kv_disk_path" not in overrides:  # a disk KV tier of its own, empty: no blocks of an earlier run
        overrides["kv_disk_path"] = str(log_dir / f"kv-{mode}")
        shutil.rmtree(overrides["kv_disk_path"], ignore_errors=True)
    return Launch(
        mode=mode,
        model_dir=ensure_model(model),
        overrides=overrides,
        per_model=dict(per_model or {}),
        decode_instances=decode_instances,
        repo_dir=log_dir / f"repo-{mode}",
        log_file=log_dir / f"tritonserver-{mode}.log",
        extra_env=dict(extra_env or {}),
        openai_port=0 if openai else None,
        openai_log_file=log_dir / "openai.log",
        prometheus_port=0 if prometheus else None,
    ).start()


def start(mode: str, **kw) -> TritonServer:
    """``mode``: ``aggregated`` or ``disagg`` (1 prefill + ``decode_instances`` decode
    instances), started by the launcher ``serve`` uses (``backend/launch/launcher.py``): its core
    placement (split between the roles), a private etcd for the membership, a deployment
    secret. ``model``, ``overrides``, ``per_model``, ``log_dir``, ``decode_instances``,
    ``extra_env`` (added to the server's environment), ``prometheus`` (also start the
    Prometheus ``serve --prometheus`` starts: ``server.prometheus``). Stop it with :func:`stop`."""
    server, _ = _launch(mode, **kw)
    return server


def start_with_openai(mode: str, **kw) -> tuple[TritonServer, OpenAIFrontend]:
    """:func:`start` with the OpenAI frontend in front of it, as ``serve --openai-port`` starts
    it (routing across the membership's decode instances in a disaggregated deployment)."""
    server, frontend = _launch(mode, openai=True, **kw)
    assert frontend is not None
    return server, frontend


def stop(server: TritonServer, frontend: OpenAIFrontend | None = None) -> None:
    """Stop what :func:`start` / :func:`start_with_openai` started (and the private etcd)."""
    from backend.launch.launcher import stop as stop_all

    stop_all(server, frontend)


@contextmanager
def started_with_openai(mode: str, log_dir: Path, **kw) -> Iterator[tuple[TritonServer, OpenAIFrontend]]:
    """:func:`start_with_openai` for a ``with`` block that stops both as it ends."""
    server, frontend = start_with_openai(mode, log_dir=log_dir, **kw)
    try:
        yield server, frontend
    finally:
        stop(server, frontend)


@contextmanager
def started(mode: str, **kw) -> Iterator[TritonServer]:
    """``start(mode, **kw)`` for a ``with`` block, which stops the server as it ends."""
    server = start(mode, **kw)
    try:
        yield server
    finally:
        stop(server)


class LlamaCppServer:
    """A running llama.cpp server (``url``: ``http://127.0.0.1:PORT``); ``stop()`` ends it, and
    ``with`` does too."""

    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc, self.url = proc, url
        self._client: Any = None  # the OpenAI client, made on first use

    def wait_ready(self, timeout_s: float = 120.0) -> LlamaCppServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama.cpp server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError("llama.cpp server not ready")

    def stream(self, prompt: str, tokens: int) -> list[float]:
        """Arrival times of the tokens of one greedy completion with end of sequence off
        (llama-cpp-python sends one token per chunk, then a final chunk with no text)."""
        if self._client is None:
            from openai import OpenAI

            self._client = OpenAI(base_url=f"{self.url}/v1", api_key="none")
        times = []
        stream = self._client.completions.create(
            model="baseline",
            prompt=prompt,
            max_tokens=tokens,
            temperature=0.0,
            stream=True,
            extra_body={"logit_bias_type": "input_ids", "logit_bias": {LLAMA_CPP_EOS: -100.0}},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
        return times

    def timed_streams(self, prompt: str, tokens: int, streams: int) -> list[list[float]]:
        """A warm-up, then ``streams`` streams of ``tokens`` tokens one after the other: each
        one's token arrival times (a stream of fewer than half the tokens is an error)."""
        self.stream("warm up", 8)
        out = []
        for _ in range(streams):
            times = self.stream(prompt, tokens)
            if len(times) < tokens // 2:
                raise RuntimeError(f"llama.cpp streamed {len(times)} of {tokens} tokens")
            out.append(times)
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def __enter__(self) -> LlamaCppServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# llama.cpp builds for the CPU it is built on (-march=native), but without its AMX kernels: on an
# Intel Xeon with AMX (family 6, model 167, 2026-12-03) ggml_backend_amx_mul_mat crashed the server
# (SIGSEGV) at its first completion on the Q4_1 GGUF. The flags are no-ops on CPUs without AMX.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CPP_BUILD = {"CMAKE_ARGS": f"-DCMAKE_C_FLAGS='{NO_AMX}' -DCMAKE_CXX_FLAGS='{NO_AMX}'"}


def llama_cpp_python() -> Path:
    """The Python of llama.cpp's tool venv, ``llama-cpp-python[server]`` built and installed on
    first use (:data:`LLAMA_CPP_BUILD`)."""
    return ensure_tool("llama-cpp", LLAMA_CPP, "python", env=LLAMA_CPP_BUILD)


def start_llama_cpp(
    gguf: Path, threads: int, log_path: Path, *, n_ctx: int = 2048, extra: tuple[str, ...] = ()
) -> LlamaCppServer:
    """llama.cpp's server on ``gguf`` with ``threads`` threads, a free local port and its log in
    ``log_path`` (``extra``: more server options), once it answers."""
    from backend.launch.ports import free_port

    python = llama_cpp_python()
    port = free_port()
    cmd = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", str(threads)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx), *extra]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        server = LlamaCppServer(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}")
    try:
        return server.wait_ready()
    except BaseException:
        server.stop()
        raise
