"""A ``tritonserver`` start that crashes (a stub's fatal signal, a C++ exception: what a start
under load showed, issue 58) is retried once with the reason logged; a start that fails otherwise
(a bad configuration) is not, and a second crash is not retried again. On a fake server process
(a script that crashes or answers Triton's readiness endpoint, counting its starts)."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest

from backend.launch.server import TritonServer

FAKE = textwrap.dedent(
    """
    import http.server, pathlib, sys
    port, state, first, later = int(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    n = int(state.read_text()) if state.exists() else 0
    state.write_text(str(n + 1))
    how = first if n == 0 else later
    if how == "bus":
        print("I1207 model_lifecycle.cc] loading: decode_0:1", flush=True)
        print("Fatal Python error: Bus error", flush=True)
        print("terminate called after throwing an instance of 'boost::interprocess::lock_exception'", flush=True)
        sys.exit(1)
    if how == "config":
        print("E1207 model_config_utils.cc] unexpected field 'instance_grup'", flush=True)
        sys.exit(1)

    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/v2/health/ready" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Ready).serve_forever()
    """
)


def fake_server(tmp_path, monkeypatch, first: str, later: str) -> TritonServer:
    script, state = tmp_path / "fake_tritonserver.py", tmp_path / "starts"
    script.write_text(FAKE)
    (tmp_path / "repo").mkdir()
    server = TritonServer(tmp_path / "repo", log_file=tmp_path / "server.log", supervise=False)
    cmd = [sys.executable, str(script), str(server.http_port), str(state), first, later]
    monkeypatch.setattr(server, "command", lambda: cmd)
    return server


def starts(tmp_path) -> int:
    return int((tmp_path / "starts").read_text())


def test_a_start_that_crashed_is_retried_once_with_its_reason(tmp_path, monkeypatch, caplog):
    server = fake_server(tmp_path, monkeypatch, first="bus", later="ready")
    with caplog.at_level(logging.WARNING, logger="triton_disagg.server"):
        server.start(timeout_s=60)
    try:
        assert starts(tmp_path) == 2 and server.is_ready()
        (line,) = [r.getMessage() for r in caplog.records if "crashed while starting" in r.getMessage()]
        assert "Fatal Python error: Bus error" in line and "starting it again, once" in line, line
    finally:
        server.stop(timeout_s=5, drain=False)


def test_a_start_that_failed_for_its_configuration_is_not_retried(tmp_path, monkeypatch):
    server = fake_server(tmp_path, monkeypatch, first="config", later="ready")
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 1 before it was ready.*instance_grup"):
        server.start(timeout_s=60)
    assert starts(tmp_path) == 1 and server.proc is None


def test_a_start_that_crashes_again_fails_with_the_second_crash(tmp_path, monkeypatch):
    server = fake_server(tmp_path, monkeypatch, first="bus", later="bus")
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 1 before it was ready.*Bus error"):
        server.start(timeout_s=60)
    assert starts(tmp_path) == 2
    # an earlier start's crash in the same log is not this start's
    server._last_exit, server._log_offset = 1, (tmp_path / "server.log").stat().st_size
    assert server.crash_reason() is None
