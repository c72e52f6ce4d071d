"""Start, stop and restart a real ``tritonserver`` on a model repository, and wait until it is ready.

The server runs with explicit model control, so a :class:`Supervisor`
(``backend/launch/supervisor.py``) can reload a model whose instance died. A stop drains
first (``backend/triton/lifecycle.py``): the models end their streams, then Triton gets SIGINT
and unloads everything within its exit timeout."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import requests

from backend.cluster.tracing import TRACE_HEADER
from backend.disagg import auth
from backend.disagg.auth import SECRET_ENV, accept_renamed
from backend.launch.ports import free_port
from backend.launch.triton_install import install_stub
from backend.serving.discovery import GRPC_URL_ENV, METRICS_URL_ENV
from backend.triton.lifecycle import RELOAD_PREFIX, drain_file, drain_now_file

if TYPE_CHECKING:
    from backend.launch.etcd_server import EtcdServer
    from backend.launch.kv_store_server import KVStoreServer
    from backend.launch.prometheus_server import PrometheusServer
    from backend.launch.supervisor import Supervisor

log = logging.getLogger("triton_disagg.server")


def trace_arguments(otlp_endpoint: str, instance: str) -> list[str]:
    """Triton's OpenTelemetry trace mode, every request traced: it reads the ``traceparent``
    header of every HTTP endpoint (``generate_stream`` too, which forwards no header) and gRPC
    call, exports Triton's own spans (the request, the model, its compute; OTLP/HTTP in JSON) to
    the deployment's collector, and hands each model its span's context in the client's trace."""
    config = [
        "mode=opentelemetry",
        "rate=1",
        "level=TIMESTAMPS",
        f"opentelemetry,url={otlp_endpoint}/v1/traces",
        "opentelemetry,resource=service.name=tritonserver",
        f"opentelemetry,resource=service.instance.id={instance}",
    ]
    return [arg for c in config for arg in ("--trace-config", c)]


class TritonServer:
    """One ``tritonserver`` process bound to ``host`` with the given ports."""

    def __init__(
        self,
        model_repository: str | Path,
        *,
        host: str = "127.0.0.1",
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        log_file: str | Path | None = None,
        extra_env: dict | None = None,
        log_verbose: int = 0,
        netns: str | None = None,
        supervise: bool = True,
        exit_timeout_s: int = 10,
        otlp_endpoint: str = "",
    ):
        self.repo = Path(model_repository).resolve()
        self.host = host
        # ports are picked on loopback: ``host`` may live in another network namespace
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log_file = Path(log_file) if log_file else None
        self.extra_env = extra_env or {}
        self.log_verbose = log_verbose
        self.netns = netns
        self.supervise = supervise
        self.exit_timeout_s = exit_timeout_s
        self.otlp_endpoint = otlp_endpoint.rstrip("/")
        self.supervisor: Supervisor | None = None
        self.etcd: EtcdServer | None = None  # the deployment's private etcd, if its launcher started one
        self.kv_store: KVStoreServer | None = None  # its private shared-KV-tier store, likewise
        self.prometheus: PrometheusServer | None = None  # the Prometheus scraping the deployment, likewise
        self.proc: subprocess.Popen | None = None
        self.deployment_secret = ""  # the deployment secret, set at the first start, kept over restarts
        self._last_exit: int | None = None  # the exit status of a start that ended before it was ready
        self._log_offset = 0  # where the last start's output begins in the log

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        inst = install_stub()
        cmd = [
            str(inst.server_bin),
            "--model-repository",
            str(self.repo),
            "--backend-directory",
            str(inst.backend_dir),
            "--http-address",
            self.host,
            "--http-port",
            str(self.http_port),
            "--grpc-address",
            self.host,
            "--grpc-port",
            str(self.grpc_port),
            "--metrics-address",
            self.host,
            "--metrics-port",
            str(self.metrics_port),
            "--allow-metrics",
            "true",
            "--allow-gpu-metrics",
            "false",
            "--allow-cpu-metrics",
            "false",
            "--exit-timeout-secs",
            str(self.exit_timeout_s),
            # our configs are complete and no model.py has ``auto_complete_config``: without this
            # flag the Python backend starts one more stub per model that only imports model.py
            # (torch and all) and exits: a disagg server started in 17.7 s with it, 10.9 s without
            "--disable-auto-complete-config",
            "--model-control-mode=explicit",
            "--load-model=*",
            f"--log-verbose={self.log_verbose}",
            # a client's W3C trace context (gRPC metadata; an HTTP header on the infer endpoint, not
            # on generate or generate_stream) reaches the models as a request parameter
            # (backend/triton/trace_context.py)
            f"--http-header-forward-pattern={TRACE_HEADER}",
            f"--grpc-header-forward-pattern={TRACE_HEADER}",
        ]
        if self.otlp_endpoint:
            cmd += trace_arguments(self.otlp_endpoint, self.grpc_url)
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns] + cmd
        return cmd

    def start(self, timeout_s: float = 300.0) -> "TritonServer":
        """Start ``tritonserver`` and wait until it is ready. A start that crashed (the server or
        one of its stubs died of a signal, or of a C++ exception, before it was ready) is retried
        once, its reason logged; one that failed otherwise (a bad configuration, a model that
        refused to load, the timeout) is not."""
        try:
            return self._start_once(timeout_s)
        except RuntimeError as e:
            reason = self.crash_reason()
            if reason is None:
                raise
            log.warning("tritonserver crashed while starting (%s): starting it again, once; %s", reason, e)
            return self._start_once(timeout_s)

    def crash_reason(self) -> str | None:
        """Why the last start crashed, from its exit status and its log's tail (a stub's fatal
        signal, an uncaught C++ exception); None when it did not crash."""
        code = self._last_exit
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        if code is None or not self.log_file:
            return None
        try:
            with open(self.log_file, "rb") as f:  # what this start wrote
                f.seek(self._log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return None
        for line in text.splitlines():
            for mark in ("Fatal Python error:", "terminate called after throwing"):
                if mark in line:
                    return line[line.index(mark) :].strip()[:200]
        return None

    def _start_once(self, timeout_s: float) -> "TritonServer":
        self._last_exit = None
        self._log_offset = self.log_file.stat().st_size if self.log_file and self.log_file.exists() else 0
        # the deployment secret (also under its old name, for a release): one per server unless
        # the caller shares one; kept over restarts
        env = accept_renamed({**install_stub().server_env(), **self.extra_env})
        env.setdefault(SECRET_ENV, self.deployment_secret or auth.new_secret())
        env.setdefault(GRPC_URL_ENV, self.grpc_url)  # what the instances register for routers
        env.setdefault(METRICS_URL_ENV, self.metrics_url)  # ... and for autoscalers
        self.deployment_secret = env[SECRET_ENV]
        drain_file(self.repo).unlink(missing_ok=True)  # left by a stop that was cut short
        drain_now_file(self.repo).unlink(missing_ok=True)
        for request in self.repo.glob(f"{RELOAD_PREFIX}*"):  # a reload asked of a server since gone
            request.unlink(missing_ok=True)
        out = open(self.log_file, "ab") if self.log_file else None
        log.info(
            "starting tritonserver: repository %s, http %s, grpc %s, metrics %s",
            self.repo,
            self.http_url,
            self.grpc_url,
            self.metrics_port,
        )
        self.proc = subprocess.Popen(
            self.command(),
            env=env,
            stdout=out or None,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )
        if out:
            out.close()
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop(timeout_s=5.0, drain=False)  # nothing was served: no drain
            raise
        if self.supervise:
            from backend.launch.supervisor import Supervisor

            self.supervisor = Supervisor(self).start()
        return self

    def restart(self, timeout_s: float = 300.0) -> "TritonServer":
        """Start again after the process exited on its own, with the same repository, ports,
        environment and secret; what is left of the old one (stubs in its process group) is
        killed first."""
        self.stop(drain_timeout_s=0.0)
        return self.start(timeout_s)

    def is_ready(self) -> bool:
        try:
            return requests.get(f"http://{self.http_url}/v2/health/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                self._last_exit = self.proc.returncode
                raise RuntimeError(
                    f"tritonserver exited with code {self.proc.returncode} before it was ready" + self.log_tail()
                )
            if self.is_ready():
                assert self.proc is not None
                log.info("tritonserver ready (pid %d)", self.proc.pid)
                return
            time.sleep(0.5)
        self.dump_stub_stacks()
        raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f}s" + self.log_tail(200))

    def stub_pids(self) -> list[int]:
        """The Python-backend stub processes of this server (its process group, but itself)."""
        if self.proc is None:
            return []
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == self.proc.pid:
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            comm, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == self.proc.pid and comm.startswith("triton_python"):
                pids.append(int(entry.name))
        return pids

    def stub_shm_regions(self) -> list[str]:
        """The shared-memory regions of this server's stubs (the stub's second argument); Triton
        removes them when it exits, but not when it is killed."""
        regions = []
        for pid in self.stub_pids():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if len(argv) > 2 and argv[2].startswith(b"triton_python_backend_shm_region"):
                regions.append(argv[2].decode())
        return regions

    def dump_stub_stacks(self) -> None:
        """Ask every stub to print its threads' Python stacks into the log (``backend/triton``
        registers the handler); a stub that has not imported it yet dies of the signal, which
        changes nothing for a server being given up on."""
        pids = self.stub_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        if pids:
            time.sleep(1.0)

    def log_tail(self, lines: int = 60) -> str:
        """The last lines of the server's log, for an error that says why it failed to start (or
        why a stub died)."""
        if not self.log_file:
            return ""
        try:
            text = Path(self.log_file).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"; see {self.log_file}"
        return f"; the last {len(text)} lines of {self.log_file}:\n" + "\n".join(text)

    def stop(self, timeout_s: float = 30.0, drain_timeout_s: float = 5.0, drain: bool = True) -> None:
        """Drain (the models end their requests; not with ``drain=False``), SIGINT (graceful:
        Triton unloads every model within its exit timeout), then SIGKILL of the whole process
        group (stubs included)."""
        if self.proc is None:
            return
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        regions = self.stub_shm_regions()
        if self.proc.poll() is None:
            if drain:
                self.drain(drain_timeout_s)
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout_s)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
            drain_file(self.repo).unlink(missing_ok=True)
            drain_now_file(self.repo).unlink(missing_ok=True)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None
        for region in regions:  # what a killed server leaves in /dev/shm
            Path("/dev/shm", region).unlink(missing_ok=True)

    def drain(self, timeout_s: float) -> None:
        """Drain every model (they leave the membership, take nothing new and let their requests
        finish); after ``timeout_s`` tell them to end what is still in flight (with the drain
        message, before Triton closes its endpoints)."""
        drain_file(self.repo).touch()
        if self._wait_idle(timeout_s):
            return
        log.warning("drain: requests still active after %.0fs; ending them", timeout_s)
        drain_now_file(self.repo).touch()
        if not self._wait_idle(5.0):
            log.warning("drain: requests still active; stopping anyway")

    def _wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.requests_active() == 0:
                time.sleep(0.5)  # the models let go of their last responses
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def requests_active(self) -> float | None:
        """Sum of ``triton_disagg_requests_active`` over the models (None: metrics unreadable)."""
        try:
            text = requests.get(self.metrics_url, timeout=2).text
        except requests.RequestException:
            return None
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("triton_disagg_requests_active{")
        )

    def instance_pids(self) -> dict[str, int]:
        """Python-backend stub processes of this server: model instance name -> pid."""
        import psutil

        out: dict[str, int] = {}
        if self.proc is None:
            return out
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:  # the server exited
            return out
        for child in children:
            try:
                if child.status() == psutil.STATUS_ZOMBIE:  # a dead stub Triton has not reaped
                    continue
                args = child.cmdline()
            except psutil.Error:
                continue
            if args and args[0].endswith("triton_python_backend_stub") and len(args) > 8:
                out[args[-2]] = child.pid
        return out

    @staticmethod
    def stub_alive(pid: int) -> bool:
        """Whether the stub process ``pid`` still runs (a zombie Triton has not reaped does not)."""
        import psutil

        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:  # a zombie too
            return False
        except psutil.AccessDenied:  # it exists
            return True

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
