"""Start and stop a private single-member ``etcd`` (tests and single-host deployments): its own
data directory, client and peer ports on ``host``, its log in a file; ``kill()`` keeps the data
directory so that ``start()`` again brings the same store back on the same ports. Its history is
compacted every 5 minutes: decode instances write their records again as their health and cache
summaries change, and an uncompacted history would grow until etcd's space quota refuses every
write (an etcd of your own needs the same, ``--auto-compaction-retention``)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import requests

from backend.launch.ports import free_port
from backend.launch.service_process import ServiceProcess

log = logging.getLogger("triton_disagg.etcd")


def etcd_binary() -> str | None:
    """The path of the ``etcd`` executable, or None when it is not installed."""
    found = shutil.which("etcd")
    if found:
        return found
    for candidate in ("/usr/bin/etcd", "/usr/local/bin/etcd"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


class EtcdServer(ServiceProcess):
    """One ``etcd`` process; ``data_dir`` None: a temporary one, removed by ``stop()``."""

    name = "etcd"

    def __init__(
        self,
        data_dir: str | Path | None = None,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        log_file: str | Path | None = None,
        name: str = "triton-disagg",
    ) -> None:
        self.host = host
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.name = name
        self._own_root: Path | None = None
        if data_dir is None:
            self._own_root = Path(tempfile.mkdtemp(prefix="triton-disagg-etcd-"))
            self.data_dir = self._own_root / "data"
        else:
            self.data_dir = Path(data_dir)
        if log_file is not None:
            super().__init__(Path(log_file))
        elif self._own_root is not None:
            super().__init__(self._own_root / "etcd.log")
        else:
            super().__init__(self.data_dir.with_name(self.data_dir.name + ".etcd.log"))

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.client_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    def command(self) -> list[str]:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd is not installed (scripts/setup.sh installs Debian's etcd-server as root)")
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        return [
            binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            "--logger", "zap",
            "--log-outputs", "stderr",
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", "5m",
        ]  # fmt: skip

    def start(self, timeout_s: float = 20.0) -> EtcdServer:
        """Start etcd and wait until it answers ``/health`` (a leader elected); raise with the
        tail of its log if it exits or does not answer within ``timeout_s``."""
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self._launch(self.command(), self._healthy, self.url, timeout_s)
        assert self.proc is not None
        log.info("etcd %s serving (pid %d, data %s)", self.url, self.proc.pid, self.data_dir)
        return self

    def _healthy(self) -> bool:
        try:
            answer = requests.get(self.http_url + "/health", timeout=1.0)
            return answer.status_code == 200 and answer.json().get("health") == "true"
        except (requests.RequestException, ValueError):
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash would; the data directory stays for a ``start()`` again."""
        super().kill()

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; a temporary data directory is removed."""
        super().stop(timeout_s)
        if self._own_root is not None:
            shutil.rmtree(self._own_root, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start() if not self.running() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
