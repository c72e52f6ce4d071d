"""One way to start a server of a deployment on this machine: ``triton-disagg serve``, the test
fixtures and ``triton-disagg bench`` all describe what they want as a :class:`Launch` and call
:meth:`Launch.start`, so the benchmarks measure the deployment ``serve`` runs.

What a start does, in order: the deployment secret (a file given, the environment's, or, for a
``disagg`` server that has none, a new one in a file next to the repository that other servers
and ``triton-disagg drain`` can be given); the membership (the ``discovery`` etcd given, or a
private etcd for a ``disagg`` server, as ``serve`` prints); the model repository rendered for
the mode (``backend/launch/deployment.py``, with its core placement); the ``tritonserver``
(``backend/launch/server.py``); with ``openai_port`` the OpenAI frontend, which routes across
every decode instance of the membership. :func:`stop` drains and stops all of it, the private
etcd last (the instances deregister while they stop).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backend.disagg.auth import SECRET_ENV, env_secret, new_secret
from backend.launch.deployment import render_deployment
from backend.launch.server import TritonServer

if TYPE_CHECKING:
    from backend.launch.openai_frontend import OpenAIFrontend
    from backend.launch.prometheus_server import PrometheusServer

log = logging.getLogger("triton_disagg.launch")
SPLIT_MODES = ("disagg", "prefill", "decode")


class LaunchError(ValueError):
    """The launch is refused before anything starts; the message says what to give."""


@dataclass
class Launch:
    """What to start. ``overrides``: parameters for every model; ``per_model``: for a model or a
    role (``backend/launch/deployment.py``); ``placement``: how a ``disagg`` server's cores are
    split between the roles (``deployment.PLACEMENTS``). ``secret_file``: the deployment
    secret's file ("" : the environment's, else a new one for ``disagg``). ``discovery``: the
    deployment's etcd ("" : a private one for ``disagg``; ``prefill``/``decode`` need one unless
    ``prefill_endpoints`` fixes the prefill instances). ``openai_port``: also start the OpenAI
    frontend there (0: a free port; None: none). ``kv_store``: the shared KV tier's store
    (``redis://HOST:PORT``; "" : a private one of ``kv_store_bytes`` for ``disagg`` where
    ``redis-server`` is installed, none otherwise; ``none``: no shared tier). ``otlp_endpoint``:
    the OpenTelemetry collector every process exports its trace spans to ("" : no tracing).
    ``prometheus_port``: also start a Prometheus there that scrapes the deployment (0: a free
    port; None: none; ``prometheus_server.py``)."""

    mode: str = "aggregated"
    model_dir: str | Path = ""
    overrides: dict = field(default_factory=dict)
    per_model: dict = field(default_factory=dict)
    prefill_instances: int = 1
    decode_instances: int = 1
    with_aggregated: bool = False
    placement: str = "split"
    discovery: str = ""
    deployment: str = ""
    prefill_endpoints: list[str] | None = None
    secret_file: str = ""
    messenger_host: str = "127.0.0.1"
    etcd_host: str = ""
    repo_dir: Path | None = None
    host: str = "127.0.0.1"
    http_port: int | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    log_file: str | Path | None = None
    extra_env: dict = field(default_factory=dict)
    router: dict = field(default_factory=dict)
    openai_port: int | None = None
    openai_log_file: str | Path | None = None
    kv_store: str = ""
    kv_store_bytes: int = 2 << 30
    otlp_endpoint: str = ""
    prometheus_port: int | None = None
    timeout_s: float = 400.0
    # what the start used: the membership's etcd and the secret's file ("" : none / the environment's)
    used_discovery: str = field(default="", init=False)
    used_secret_file: str = field(default="", init=False)

    def check(self) -> None:
        """Refuse what cannot start, naming what to give (nothing has started yet)."""
        if self.mode in ("prefill", "decode"):
            if not (self.secret_file or env_secret() or SECRET_ENV in self.extra_env):
                raise LaunchError(
                    f"--mode {self.mode}: both sides of a split deployment must share the deployment secret: "
                    f"give --deployment-secret-file FILE (or set {SECRET_ENV}) on every server"
                )
            if not self.discovery and not self.prefill_endpoints:
                raise LaunchError(
                    f"--mode {self.mode}: give --discovery etcd://HOST:PORT, the etcd of the deployment to join "
                    "(`serve --mode disagg` prints it)"
                )
        if self.openai_port is not None and self.mode == "prefill":
            raise LaunchError("--openai-port: a prefill-only server has no model that answers requests")

    def start(self) -> tuple[TritonServer, OpenAIFrontend | None]:
        """Start everything; on a failure, what started is stopped again. ``server.etcd`` is the
        private etcd when one was started."""
        self.check()
        repo_dir = Path(self.repo_dir or tempfile.mkdtemp(prefix="triton-disagg-repo-"))
        overrides = dict(self.overrides)
        if self.otlp_endpoint:
            overrides["otlp_endpoint"] = self.otlp_endpoint
        extra_env = dict(self.extra_env)
        if self.secret_file:
            overrides["deployment_secret_file"] = str(Path(self.secret_file).resolve())
        elif self.mode == "disagg" and not env_secret() and SECRET_ENV not in extra_env:
            # a new one, also in a file the operator can hand to servers that join and to
            # `triton-disagg drain`
            secret = new_secret()
            secret_file = repo_dir.with_name(repo_dir.name + ".secret")
            secret_file.write_text(secret)
            secret_file.chmod(0o600)
            overrides["deployment_secret_file"] = str(secret_file)
            extra_env[SECRET_ENV] = secret
        self.used_secret_file = overrides.get("deployment_secret_file", "")
        etcd = None
        discovery = self.discovery
        if self.mode == "disagg" and not discovery and not self.prefill_endpoints:
            from backend.launch.etcd_server import EtcdServer, etcd_binary

            if etcd_binary() is None:
                raise LaunchError(
                    "--mode disagg keeps its membership in etcd, which is not installed (scripts/setup.sh)"
                )
            etcd = EtcdServer(
                host=self.etcd_host or self.messenger_host,
                data_dir=repo_dir.with_name(repo_dir.name + ".etcd"),
                log_file=repo_dir.with_name(repo_dir.name + ".etcd.log"),
            ).start()
            discovery = etcd.url
        self.used_discovery = discovery
        server = None
        frontend = None
        store = None
        try:
            store = self._kv_store(repo_dir, overrides)
            repo = render_deployment(
                repo_dir,
                mode=self.mode,
                model_path=str(self.model_dir),
                overrides=overrides,
                prefill_instances=self.prefill_instances,
                decode_instances=self.decode_instances,
                per_model={**self.per_model, **({"front": self.router} if self.router else {})},
                prefill_endpoints=self.prefill_endpoints,
                messenger_host=self.messenger_host,
                with_aggregated=self.with_aggregated,
                discovery=discovery,
                deployment=self.deployment,
                placement=self.placement,
            )
            server = TritonServer(
                repo,
                host=self.host,
                http_port=self.http_port,
                grpc_port=self.grpc_port,
                metrics_port=self.metrics_port,
                log_file=self.log_file,
                extra_env=extra_env,
                otlp_endpoint=str(overrides.get("otlp_endpoint", "")),
            )
            server.etcd = etcd
            server.kv_store = store
            if self.mode != "aggregated":
                log.info("membership: %s (deployment %r)", discovery or "none", self.deployment or "default")
            server.start(timeout_s=self.timeout_s)
            if self.openai_port is not None:
                frontend = self._frontend(server, discovery, overrides.get("deployment_secret_file", ""))
                frontend.start()
            if self.prometheus_port is not None:
                server.prometheus = self._prometheus(server, discovery, repo_dir, frontend)
        except BaseException:
            if server is not None:
                stop(server, frontend, 0.0)
            else:
                for service in (store, etcd):
                    if service is not None:
                        service.stop()
            raise
        return server, frontend

    def _kv_store(self, repo_dir: Path, overrides: dict):
        """The shared KV tier's store for every instance (``kv_store_url``): the one named, or a
        private one started here (returned, to stop with the server), or none."""
        if "kv_store_url" in overrides or self.kv_store == "none":
            return None
        if self.kv_store:
            overrides["kv_store_url"] = self.kv_store
            return None
        if self.mode != "disagg":
            return None
        from backend.launch.kv_store_server import KVStoreServer, redis_binary

        if redis_binary() is None:
            log.warning("no shared KV tier: redis-server is not installed (scripts/setup.sh installs it)")
            return None
        store = KVStoreServer(
            host=self.etcd_host or self.messenger_host,
            max_bytes=self.kv_store_bytes,
            log_file=repo_dir.with_name(repo_dir.name + ".redis.log"),
        ).start()
        overrides["kv_store_url"] = store.url
        return store

    def _frontend(self, server: TritonServer, discovery: str, secret_file: str) -> OpenAIFrontend:
        from backend.launch.openai_frontend import OpenAIFrontend

        # with the membership it routes across every decode instance (any server) and moves
        # requests between them; aggregated: the one llm model
        member: dict[str, Any] = {}
        if self.mode in ("disagg", "decode") and discovery:
            member = {
                "discovery": discovery,
                "deployment": self.deployment or "default",
                "deployment_secret_file": secret_file or None,
                "extra_env": {SECRET_ENV: server.deployment_secret},
                "router": self.router,
            }
        return OpenAIFrontend(
            server.grpc_url,
            self.model_dir,
            host=self.host,
            port=self.openai_port or None,
            log_file=self.openai_log_file,
            otlp_endpoint=self.otlp_endpoint or str(self.overrides.get("otlp_endpoint", "")),
            **member,
        )

    def _prometheus(
        self, server: TritonServer, discovery: str, repo_dir: Path, frontend: OpenAIFrontend | None
    ) -> PrometheusServer:
        from backend.launch.prometheus_server import PrometheusServer

        static = [] if discovery else [server.metrics_url]  # without membership: this server alone
        if frontend is not None:
            static.append(f"{frontend.url}/metrics")
        prometheus = PrometheusServer(
            host=self.host,
            port=self.prometheus_port or None,
            folder=repo_dir.with_name(repo_dir.name + ".prometheus"),
            static=static,
        ).start()
        if discovery:
            prometheus.follow(discovery, self.deployment or "default", server.deployment_secret.encode())
        return prometheus


def stop(server: TritonServer, frontend: OpenAIFrontend | None = None, drain_timeout_s: float = 5.0) -> None:
    """Stop what :meth:`Launch.start` started: the frontend, the server (draining first for
    ``drain_timeout_s``), its private etcd last."""
    try:
        if frontend is not None:
            frontend.stop()
        server.stop(drain_timeout_s=drain_timeout_s)
    finally:
        if server.prometheus is not None:
            server.prometheus.close()
        if server.kv_store is not None:
            server.kv_store.stop()
        if server.etcd is not None:
            server.etcd.stop()  # last: the instances deregister while they stop
