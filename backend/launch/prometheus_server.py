"""A real Prometheus for a deployment (Debian's ``prometheus``, installed by ``scripts/setup.sh``):
``serve --prometheus PORT`` starts one, and the tests.

It scrapes every server of the deployment: the scrape targets live in a file that Prometheus
watches (``file_sd_configs``), rewritten as the deployment's membership changes
(:meth:`PrometheusServer.follow`: every record's ``metrics_url``, one target per server, labelled
with the roles and instances it holds), so a server that joins becomes a target, and one that
leaves stops being one, without a restart; ``static`` targets (a server without membership, the
OpenAI frontend, an autoscaler) are added to them. It loads the recording and alert rules of
``deploy/prometheus/triton-disagg-rules.yml`` (TTFT and ITL percentiles, goodput, pool use; an
SLO burn, a KV pool nearly full, an instance missing, migrations rising). Its data stays in its
folder; it evaluates and scrapes every ``interval_s``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from collections import defaultdict
from pathlib import Path
from urllib.parse import urlsplit

import requests

from backend.cluster.etcd import EtcdClient
from backend.cluster.membership import Membership
from backend.cluster.records import InstanceRecord
from backend.launch.ports import free_port
from backend.launch.service_process import ServiceProcess

log = logging.getLogger("triton_disagg.launch")

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "triton-disagg-rules.yml"
JOB = "triton-disagg"


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class PrometheusServer(ServiceProcess):
    name = "prometheus"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        folder: Path | None = None,
        interval_s: float = 5.0,
        static: list[str] | None = None,
    ) -> None:
        self.folder = Path(folder or tempfile.mkdtemp(prefix="triton-disagg-prometheus-"))
        super().__init__(self.folder / "prometheus.log")
        self.host = host
        self.port = port or free_port()
        self.interval_s = interval_s
        self.static = list(static or [])
        self.targets_file = self.folder / "targets.json"
        self.config_file = self.folder / "prometheus.yml"
        self._members: dict[str, InstanceRecord] = {}
        self._lock = threading.Lock()
        self._membership: Membership | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def config(self) -> str:
        """The configuration file's text (YAML; JSON is YAML)."""
        interval = f"{self.interval_s:g}s"
        return json.dumps(
            {
                "global": {"scrape_interval": interval, "evaluation_interval": interval},
                "rule_files": [str(RULES)],
                "scrape_configs": [
                    {
                        "job_name": JOB,
                        "file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": interval}],
                    }
                ],
            },
            indent=2,
        )

    def start(self, timeout_s: float = 30.0) -> PrometheusServer:
        binary = prometheus_binary()
        if binary is None:
            raise RuntimeError("prometheus is not installed (scripts/setup.sh installs Debian's prometheus)")
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write_targets()
        self.config_file.write_text(self.config())
        command = [
            binary,
            f"--config.file={self.config_file}",
            f"--storage.tsdb.path={self.folder / 'data'}",
            f"--web.listen-address={self.host}:{self.port}",
            "--storage.tsdb.retention.time=7d",
        ]
        self._launch(command, self._ready, self.url, timeout_s)
        assert self.proc is not None
        log.info("prometheus %s serving (pid %d, rules %s)", self.url, self.proc.pid, RULES)
        return self

    def follow(self, discovery: str, deployment: str, secret: bytes) -> PrometheusServer:
        """Scrape every server of ``deployment``'s membership (``etcd://HOST:PORT``), as it changes."""
        self._membership = Membership(EtcdClient(discovery), deployment, secret, on_change=self._changed)
        return self

    def targets(self) -> list[dict]:
        """What the targets file says: ``[{"targets": ["host:port"], "labels": {...}}]``."""
        by_url: dict[str, list[InstanceRecord]] = defaultdict(list)
        with self._lock:
            for record in self._members.values():
                if record.metrics_url:
                    by_url[record.metrics_url].append(record)
        groups = []
        for url in sorted(set(by_url) | set(self.static)):
            parts = urlsplit(url if "://" in url else f"http://{url}")
            records = by_url.get(url, [])
            labels = {
                "__metrics_path__": parts.path or "/metrics",
                "roles": ",".join(sorted({r.role for r in records})) or "static",
                "members": ",".join(sorted(r.name for r in records)),
            }
            groups.append({"targets": [parts.netloc], "labels": labels})
        return groups

    def close(self) -> None:
        if self._membership is not None:
            self._membership.close()
            self._membership = None
        self.stop()

    # ---------------------------------------------------------------- internals
    def _changed(self, joined: list[InstanceRecord], left: list[InstanceRecord]) -> None:
        with self._lock:
            for record in left:
                self._members.pop(record.name, None)
            for record in joined:
                self._members[record.name] = record
        self._write_targets()

    def _write_targets(self) -> None:
        """Write the file whole under another name, then rename it (Prometheus never reads half)."""
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.targets(), indent=2))
        os.replace(tmp, self.targets_file)

    def _ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except requests.RequestException:
            return False
