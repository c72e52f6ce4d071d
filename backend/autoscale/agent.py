"""``triton-disagg agent``: the process on a host that starts and stops instances for the
autoscaler. It registers in the deployment's membership (role ``agent``, its control URL in the
record, signed with the deployment secret) and serves a small control API whose every request
must carry a fresh proof of the same secret (``actuator.RequestVerifier``):

- ``GET /instances``: what it started (:class:`~backend.autoscale.actuator.Managed`, as JSON);
- ``POST /instances`` ``{"role": "prefill"|"decode"}``: start one (a ``triton-disagg serve
  --mode ROLE`` process joining the deployment, with one instance, on free ports; it is serving
  once its record appears in the membership);
- ``POST /instances/ID/stop``: stop one gracefully: SIGTERM makes ``serve`` drain (it leaves the
  membership, finishes its requests within ``--drain-timeout``, ends the rest as out of service
  so routers move them) and exit; after ``kill_after_s`` more its process group is killed.

Each instance runs in its own session: an agent that dies leaves its instances serving (they
stay in the membership and can be drained with ``triton-disagg drain``); an agent stopped with
Ctrl-C or SIGTERM stops its instances the graceful way first. At most ``max_instances`` run at
once; a start beyond it is refused (HTTP 409), so the autoscaler tries another host.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request  # here, not in app(): FastAPI resolves the handlers' annotations in these globals

from backend.autoscale.actuator import AUTH_HEADER, Managed, RequestVerifier
from backend.cluster.etcd import EtcdClient
from backend.cluster.membership import Registration
from backend.cluster.records import InstanceRecord
from backend.disagg import auth
from backend.launch.ports import free_port

log = logging.getLogger("triton_disagg.agent")
ROLES = ("prefill", "decode")


@dataclass
class AgentConfig:
    discovery: str
    secret_file: str
    deployment: str = "default"
    host: str = "127.0.0.1"  # where its instances (and its control API) listen
    messenger_host: str = ""  # the address decode instances reach a prefill's messenger on (default: host)
    port: int = 0  # the control API's port (0: a free one)
    max_instances: int = 4
    drain_timeout_s: float = 30.0
    kill_after_s: float = 60.0
    model: str = ""
    sets: list[str] = field(default_factory=list)  # --set KEY=VALUE for every instance
    role_sets: dict[str, list[str]] = field(default_factory=dict)  # role -> --ROLE-set KEY=VALUE
    log_dir: str = ""


@dataclass
class _Child:
    id: str
    role: str
    grpc_url: str
    proc: subprocess.Popen
    log_file: Path
    started_at: float
    stop_asked_at: float | None = None

    def managed(self, where: str) -> Managed:
        rc = self.proc.poll()
        detail = ""
        if rc is not None:
            try:  # the end of its log only: a log can be large
                with self.log_file.open("rb") as f:
                    f.seek(max(0, f.seek(0, 2) - 600))
                    detail = f.read().decode(errors="replace")
            except OSError:
                pass
        return Managed(
            self.id,
            self.role,
            where,
            self.grpc_url,
            rc is None,
            self.stop_asked_at is not None,
            self.started_at,
            rc,
            detail,
        )


class Agent:
    """The instances of one host: ``start(role)``, ``stop(id)``, ``instances()``; ``close()``."""

    def __init__(self, config: AgentConfig):
        self.config = config
        self.secret = auth.load_secret(config.secret_file)
        self.name = f"{socket.gethostname()}-agent-{os.getpid()}"
        self.log_dir = Path(config.log_dir or f"/tmp/triton-disagg-agent-{os.getpid()}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._children: dict[str, _Child] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._registration: Registration | None = None
        self._reaper = threading.Thread(target=self._reap, name="agent-reaper", daemon=True)
        self._closed = threading.Event()
        self._reaper.start()

    # the membership

    def register(self, control_url: str) -> None:
        record = InstanceRecord(
            deployment=self.config.deployment,
            name=self.name,
            role="agent",
            grpc_url="",
            model="",
            messenger="",
            model_identity="",
            kv_layout="",
            tp_size=1,
            started_at=time.time(),
            control_url=control_url,
        )
        self._registration = Registration(EtcdClient(self.config.discovery), record, self.secret).start()
        log.info("agent %s registers in %s with control API %s", self.name, self.config.discovery, control_url)

    # instances

    def command(self, role: str, http_port: int, grpc_port: int, metrics_port: int, log_file: Path) -> list[str]:
        c = self.config
        cmd = [sys.executable, "-m", "backend.cli", "serve", "--mode", role, f"--{role}-instances", "1"]
        cmd += ["--discovery", c.discovery, "--deployment", c.deployment]
        cmd += ["--deployment-secret-file", str(Path(c.secret_file).resolve())]
        cmd += ["--host", c.host, "--messenger-host", c.messenger_host or c.host]
        cmd += ["--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)]
        cmd += ["--drain-timeout", str(c.drain_timeout_s), "--log-file", str(log_file.with_suffix(".triton.log"))]
        if c.model:
            cmd += ["--model", c.model]
        for kv in c.sets:
            cmd += ["--set", kv]
        for kv in c.role_sets.get(role, []):
            cmd += [f"--{role}-set", kv]
        return cmd

    def instances(self) -> list[Managed]:
        with self._lock:
            return [ch.managed(self.name) for ch in self._children.values()]

    def start(self, role: str) -> Managed:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        with self._lock:
            running = sum(ch.proc.poll() is None for ch in self._children.values())
            if running >= self.config.max_instances:
                raise OverflowError(f"agent {self.name} runs {running} instances, its maximum")
            iid = f"{role}-{next(self._ids)}"
            host = self.config.host
            ports = [free_port(host) for _ in range(3)]
            log_file = self.log_dir / f"{iid}.log"
            cmd = self.command(role, ports[0], ports[1], ports[2], log_file)
            with open(log_file, "ab") as out:
                proc = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=self._repo_root()
                )
            child = _Child(iid, role, f"{host}:{ports[1]}", proc, log_file, time.time())
            self._children[iid] = child
        log.info(
            "agent: started %s instance %s (pid %d, gRPC %s, log %s)", role, iid, proc.pid, child.grpc_url, log_file
        )
        return child.managed(self.name)

    @staticmethod
    def _repo_root() -> str:
        return str(Path(__file__).resolve().parents[2])

    def stop(self, iid: str) -> Managed:
        with self._lock:
            child = self._children.get(iid)
            if child is None:
                raise KeyError(f"no instance {iid!r} here")
            if child.stop_asked_at is None and child.proc.poll() is None:
                child.stop_asked_at = time.monotonic()
                os.kill(child.proc.pid, signal.SIGTERM)
                log.info("agent: stopping %s (pid %d): it drains, then exits", iid, child.proc.pid)
            return child.managed(self.name)

    def _reap(self) -> None:
        """Kill what outlived its stop by ``kill_after_s``; forget exited instances after 10 min."""
        while not self._closed.wait(1.0):
            now = time.monotonic()
            with self._lock:
                for iid, ch in list(self._children.items()):
                    rc = ch.proc.poll()
                    if rc is None and ch.stop_asked_at is not None:
                        if now - ch.stop_asked_at > self.config.drain_timeout_s + self.config.kill_after_s:
                            log.warning(
                                "agent: %s still runs %.0f s after its stop; killing it", iid, now - ch.stop_asked_at
                            )
                            _killpg(ch.proc.pid)
                    elif rc is not None and time.time() - ch.started_at > 600 and ch.stop_asked_at is not None:
                        del self._children[iid]

    def close(self, stop_instances: bool = True, timeout_s: float | None = None) -> None:
        """Stop the instances (gracefully, waiting up to their drain plus ``kill_after_s``), then
        leave the membership."""
        if stop_instances:
            for ch in list(self._children.values()):
                if ch.proc.poll() is None:
                    self.stop(ch.id)
            deadline = time.monotonic() + (timeout_s or self.config.drain_timeout_s + self.config.kill_after_s)
            for ch in list(self._children.values()):
                try:
                    ch.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _killpg(ch.proc.pid)
                    ch.proc.wait()
        self._closed.set()
        if self._registration is not None:
            self._registration.close()


def _killpg(pid: int) -> None:
    """SIGKILL the process and everything below it (``serve`` runs tritonserver in a session of
    its own, so a process-group kill would miss it)."""
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def app(agent: Agent):
    """The control API (FastAPI)."""
    import json

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    api = FastAPI(title="triton-disagg agent")
    verifier = RequestVerifier(agent.secret)

    async def authentic(request: Request) -> JSONResponse | None:
        body = await request.body()
        try:
            verifier.check(request.headers.get(AUTH_HEADER), request.method, request.url.path, body)
        except auth.AuthError as e:
            log.warning("agent: refused %s %s from %s: %s", request.method, request.url.path, request.client, e)
            return JSONResponse({"error": str(e)}, status_code=401)
        return None

    @api.get("/instances")
    async def list_instances(request: Request):
        refused = await authentic(request)
        return refused or [m.to_json() for m in agent.instances()]

    @api.post("/instances")
    async def start_instance(request: Request):
        refused = await authentic(request)
        if refused:
            return refused
        try:
            role = json.loads(await request.body()).get("role")
            return agent.start(role).to_json()
        except (ValueError, AttributeError) as e:
            return JSONResponse({"error": f"bad request: {e}"}, status_code=400)
        except OverflowError as e:
            return JSONResponse({"error": str(e)}, status_code=409)
        except OSError as e:
            return JSONResponse({"error": f"could not start: {e}"}, status_code=500)

    @api.post("/instances/{iid}/stop")
    async def stop_instance(iid: str, request: Request):
        refused = await authentic(request)
        if refused:
            return refused
        try:
            return agent.stop(iid).to_json()
        except KeyError as e:
            return JSONResponse({"error": str(e)}, status_code=404)

    return api


def run(config: AgentConfig) -> int:
    """Serve until SIGTERM or Ctrl-C, then stop the instances gracefully."""
    import uvicorn

    agent = Agent(config)
    port = config.port or free_port(config.host)
    server = uvicorn.Server(uvicorn.Config(app(agent), host=config.host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="agent-api", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit(f"agent: the control API could not listen on {config.host}:{port}")
        time.sleep(0.05)
    agent.register(f"http://{config.host}:{port}")
    print(f"agent {agent.name}: control API http://{config.host}:{port}, logs in {agent.log_dir}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    print("agent: stopping its instances (they drain) ...", flush=True)
    agent.close(stop_instances=True)
    server.should_exit = True
    thread.join(5)
    return 0
