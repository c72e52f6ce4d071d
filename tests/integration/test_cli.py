"""The console command as a user runs it: serve (at its defaults: the weights format it picks
is logged with its reason), generate against it; ``kill -9`` of its tritonserver: serve
restarts it and it answers again on the same port; Ctrl-C (SIGINT, also where serve started with
it ignored, as a background job does) stops everything cleanly: a first Ctrl-C drains (the
requests in flight may finish), a second one stops at once even with streams in flight (they end
with "the server is shutting down")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from backend.client import stream_generate
from backend.engine.config import EngineConfig
from backend.engine.cpu_kernels import cpu_flags
from backend.launch.ports import free_port

BIN = Path(sys.executable).parent / "triton-disagg"


def test_serve_generate_and_ctrl_c(tmp_path, model_dir):
    if not BIN.exists():
        raise AssertionError(f"{BIN} missing: scripts/setup.sh installs the package")
    ports = [free_port() for _ in range(3)]
    # started as a shell starts a background job (`serve &`): SIGINT ignored on entry; serve
    # still drains on it (before it took it over, Ctrl-C did nothing in such a serve)
    proc = subprocess.Popen(
        [
            "bash",
            "-c",
            'trap "" INT; exec "$0" "$@"',
            str(BIN),
            "serve",
            "--http-port",
            str(ports[0]),
            "--grpc-port",
            str(ports[1]),
            "--metrics-port",
            str(ports[2]),
            "--set",
            "kv_cache_tokens=2048",
            "--log-file",
            str(tmp_path / "server.log"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    # serve's output is read all the time, by a thread: a pipe nobody reads fills (64 KiB) and
    # blocks serve's next print, its Ctrl-C handling included (a terminal never does that)
    lines: list[str] = []
    seen = threading.Condition()

    def pump() -> None:
        for line in proc.stdout:
            with seen:
                lines.append(line)
                seen.notify_all()
        with seen:
            seen.notify_all()

    threading.Thread(target=pump, daemon=True).start()
    read_from = [0]

    def read_until(text: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        with seen:
            while True:
                for i in range(read_from[0], len(lines)):
                    if text in lines[i]:
                        read_from[0] = i + 1
                        return lines[i]
                read_from[0] = len(lines)
                assert proc.poll() is None, "serve exited early:\n" + "".join(lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {text!r} from serve within {timeout_s:.0f}s:\n" + "".join(lines))
                seen.wait(min(left, 1.0))

    def ask_paris() -> None:
        out = subprocess.run(
            [str(BIN), "generate", "--url", f"127.0.0.1:{ports[1]}", "--chat", "What is the capital of France?"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0 and "Paris" in out.stdout, out.stdout + out.stderr

    try:
        read_until("Ctrl-C stops", 300)
        ask_paris()
        # kill -9 of the tritonserver serve started: serve restarts it on the same ports
        (triton,) = [c for c in psutil.Process(proc.pid).children() if "tritonserver" in c.name()]
        old_pids = [triton.pid] + [c.pid for c in triton.children(recursive=True)]
        t_kill = time.monotonic()
        triton.kill()
        died = read_until("tritonserver exited unexpectedly", 30)
        assert "killed by signal 9 (SIGKILL)" in died and "restart 1 " in died, died
        read_until("tritonserver restarted (restart 1)", 300)
        print(f"tritonserver restarted {time.monotonic() - t_kill:.1f}s after its kill -9")
        ask_paris()
        assert not [p for p in old_pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        server_pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert server_pids
        streams = [None, None]

        def stream(i):
            # 900 tokens: still streaming 3 s after they start at several hundred tokens/s (250 were not,
            # at 120 tokens/s each)
            streams[i] = stream_generate(
                f"127.0.0.1:{ports[1]}", "Tell me a long story.", 900, ignore_eos=True, timeout_s=120
            )

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        [t.start() for t in threads]
        time.sleep(1.5)  # both streaming
        t_stop = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: a drain begins
        time.sleep(1.5)
        assert proc.poll() is None and all(s is None for s in streams), "the drain let the streams go on"
        os.killpg(proc.pid, signal.SIGINT)  # a second Ctrl-C: stop now
        try:
            assert proc.wait(60) == 0
        except subprocess.TimeoutExpired:
            raise AssertionError(
                "serve did not stop within 60 s of a second Ctrl-C:\n" + "".join(lines[-80:])
            ) from None
        print(f"serve wrote {sum(map(len, lines))} bytes")
        stop_s = time.monotonic() - t_stop
        [t.join(30) for t in threads]
        assert all(s is not None and s.error and "the server is shutting down" in s.error for s in streams), [
            s and s.error for s in streams
        ]
        log = (tmp_path / "server.log").read_text(errors="replace")
        assert "Exit timeout expired" not in log and "successfully unloaded 'llm'" in log
        # serve's default weights format, chosen at start and said in the log with its reason
        want = EngineConfig(model_path=str(model_dir)).weights_format  # the choice: tests/unit/test_*_weights.py
        print(f"auto on this CPU ({sorted(cpu_flags() & {'avx2', 'f16c', 'fma', 'amx_bf16', 'avx512_bf16'})}): {want}")
        assert f"weights={want} (auto: " in log, [line for line in log.splitlines() if "weights=" in line]
        assert stop_s < 10, f"stop took {stop_s:.1f}s"
        time.sleep(1)
        assert not [p for p in server_pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
