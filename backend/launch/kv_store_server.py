"""Start and stop a private Redis for the shared KV tier (``serve --mode disagg`` on one machine,
and the tests): in memory only (no snapshot, no append-only file), bounded by ``max_bytes`` with
Redis's own least-recently-used eviction, listening on ``host``; its log in a file. A deployment
that spans machines names a store of its own with ``--kv-store redis://HOST:PORT``."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from backend.launch.ports import free_port
from backend.launch.service_process import ServiceProcess

log = logging.getLogger("triton_disagg.launch")


def redis_binary() -> str | None:
    return shutil.which("redis-server") or shutil.which("valkey-server")


class KVStoreServer(ServiceProcess):
    name = "redis-server"

    def __init__(
        self, host: str = "127.0.0.1", port: int | None = None, max_bytes: int = 2 << 30, log_file: Path | None = None
    ) -> None:
        super().__init__(log_file or Path(tempfile.mkdtemp(prefix="triton-disagg-kvstore-")) / "redis.log")
        self.host = host
        self.port = port or free_port()
        self.max_bytes = max_bytes

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    def command(self) -> list[str]:
        binary = redis_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/setup.sh installs Debian's redis-server)")
        return [
            binary,
            "--bind", self.host,
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", str(self.max_bytes),
            "--maxmemory-policy", "allkeys-lru",
            "--protected-mode", "no",
            "--daemonize", "no",
            "--dir", str(self.log_file.parent),
        ]  # fmt: skip

    def start(self, timeout_s: float = 20.0) -> KVStoreServer:
        self._launch(self.command(), self._answers, self.url, timeout_s)
        assert self.proc is not None
        log.info("shared KV tier store %s serving (pid %d, at most %d bytes)", self.url, self.proc.pid, self.max_bytes)
        return self

    def _answers(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(host=self.host, port=self.port, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False
