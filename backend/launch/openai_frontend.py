"""Start and stop the OpenAI-compatible frontend (``python -m backend.openai``) as its own
process next to a Triton server, and wait until it answers ``/health``."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import requests

from backend.launch.ports import free_port

log = logging.getLogger("triton_disagg.server")


class OpenAIFrontend:
    """The frontend process for the deployment at ``triton_url`` (gRPC); with ``discovery``
    (``etcd://HOST:PORT``) for the decode instances of ``deployment`` in that etcd instead, on
    any number of servers (``deployment_secret_file`` or ``extra_env``'s
    ``TRITON_DISAGG_DEPLOYMENT_SECRET``: the deployment secret that signs their records;
    ``router``: router settings by name, ``RouterSettings``'s, e.g. ``{"migration_limit": "2"}``)."""

    def __init__(
        self,
        triton_url: str,
        tokenizer: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        triton_model: str = "llm",
        served_model_name: str | None = None,
        log_file: str | Path | None = None,
        discovery: str = "",
        deployment: str = "",
        deployment_secret_file: str | Path | None = None,
        router: dict[str, str] | None = None,
        extra_env: dict[str, str] | None = None,
        otlp_endpoint: str = "",
    ):
        self.triton_url, self.tokenizer, self.host = triton_url, str(tokenizer), host
        self.port = port or free_port()
        self.triton_model = triton_model
        self.served_model_name = served_model_name or triton_model
        self.log_file = Path(log_file) if log_file else None
        self.discovery, self.deployment = discovery, deployment
        self.deployment_secret_file = str(deployment_secret_file) if deployment_secret_file else ""
        self.router = dict(router or {})
        self.extra_env = dict(extra_env or {})
        self.otlp_endpoint = otlp_endpoint
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # its start imports transformers and loads the tokenizer: 55 s on a Zen 3 busy with a test
    # suite and other deployments; a process that exits ends the wait at once
    START_TIMEOUT_S = 300.0

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the process and wait until ``/health`` says the deployment's model is ready."""
        self._launch()
        self._wait(timeout_s, lambda status: status == 200, "become healthy")
        log.info("OpenAI frontend ready on %s/v1", self.url)

    def start_process(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the process and wait until it answers HTTP (healthy or not)."""
        self._launch()
        self._wait(timeout_s, lambda status: True, "answer HTTP")

    def _launch(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "backend.openai",
            "--triton-url",
            self.triton_url,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--triton-model",
            self.triton_model,
            "--served-model-name",
            self.served_model_name,
            "--tokenizer",
            self.tokenizer,
        ]
        for flag, value in (
            ("--discovery", self.discovery),
            ("--deployment", self.deployment),
            ("--deployment-secret-file", self.deployment_secret_file),
            ("--otlp-endpoint", self.otlp_endpoint),
            *(("--" + name.replace("_", "-"), str(value)) for name, value in self.router.items()),
        ):
            if value:
                cmd += [flag, value]
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, **self.extra_env, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self._log = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115
        stdout = self._log if self._log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, env=env, cwd=root)

    def _wait(self, timeout_s: float, good, what: str) -> None:
        assert self.proc is not None, "_launch() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the OpenAI frontend exited with {self.proc.returncode} (log: {self.log_file})")
            try:
                if good(requests.get(f"{self.url}/health", timeout=2).status_code):
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"the OpenAI frontend did not {what} within {timeout_s}s (log: {self.log_file})")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGINT (uvicorn finishes open responses, bounded), then SIGKILL."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._log is not None:
            self._log.close()
        self._log = None
