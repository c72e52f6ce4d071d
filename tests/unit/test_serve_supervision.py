"""``serve`` keeps its tritonserver running (``backend/launch/restarts.py``), on fake processes
and a fake clock: a server that exits unasked is restarted, one whose exit a stop asked for is
not, at most ``--max-restarts`` times within the sliding window (0: never), and past it serve
stops everything it started and exits non-zero; a negative setting is refused before anything
starts."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from backend import cli
from backend.launch.restarts import RestartPolicy, ServerWatch


class FakeProc:
    """Answers ``poll()`` with None ``lives`` times, then ``returncode`` (calling ``on_exit`` once)."""

    def __init__(self, lives: int = 0, returncode: int = -9, on_exit=None):
        self.lives, self.exit_code, self.on_exit = lives, returncode, on_exit
        self.polls = 0
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.polls += 1
        if self.returncode is None and self.polls > self.lives:
            self.returncode = self.exit_code
            if self.on_exit is not None:
                self.on_exit()
        return self.returncode


class FakeServer:
    """``procs``: the process of each start, the first one running now; ``restart()`` moves on to
    the next one (or raises ``fail``); ``clock`` advances ``step_s`` per restart."""

    http_port, grpc_port, metrics_port, grpc_url = 8000, 8001, 8002, "127.0.0.1:8001"

    def __init__(self, *procs: FakeProc, step_s: float = 0.0, fail: Exception | None = None):
        self.pending = list(procs)
        self.proc: FakeProc | None = self.pending.pop(0)
        self.started = [self.proc]
        self.step_s, self.fail, self.now = step_s, fail, 0.0

    def clock(self) -> float:
        return self.now

    def restart(self) -> None:
        self.now += self.step_s
        if self.fail is not None:
            self.proc = None
            raise self.fail
        self.proc = self.pending.pop(0) if self.pending else FakeProc()
        self.started.append(self.proc)


def watch(server: FakeServer, max_restarts: int, window_s: float = 600.0) -> ServerWatch:
    return ServerWatch(server, RestartPolicy(max_restarts, window_s), clock=server.clock)


def test_a_server_that_exits_unasked_is_restarted_with_one_log_line(caplog):
    server = FakeServer(FakeProc(lives=2, returncode=-9), FakeProc(lives=10**6))
    w = watch(server, max_restarts=5)
    with caplog.at_level(logging.INFO, logger="triton_disagg.server"):
        down = w.run(lambda: len(server.started) == 2 and server.started[-1].polls >= 3, period_s=0)
    assert down == "" and w.restarts == 1 and len(server.started) == 2
    (line,) = [r.getMessage() for r in caplog.records if "exited unexpectedly" in r.getMessage()]
    assert "killed by signal 9 (SIGKILL)" in line and "restart 1 " in line and "--max-restarts 5" in line, line


def test_an_exit_that_a_stop_asked_for_is_not_restarted():
    stop = {"now": False}
    server = FakeServer(FakeProc(lives=3, returncode=0, on_exit=lambda: stop.update(now=True)))
    w = watch(server, max_restarts=5)
    assert w.run(lambda: stop["now"], period_s=0) == ""
    assert w.restarts == 0 and len(server.started) == 1


def test_restarts_are_bounded_within_the_window():
    # exits 100 s apart: the third one within 600 s is past --max-restarts 2
    server = FakeServer(FakeProc(returncode=1), FakeProc(), FakeProc(returncode=-6), step_s=100.0)
    w = watch(server, max_restarts=2)
    down = w.run(lambda: False, period_s=0)
    assert w.restarts == 2 and len(server.started) == 3
    assert "exited unexpectedly (killed by signal 6 (SIGABRT)) after 2 restarts within 600 s" in down
    assert "--max-restarts 2" in down


def test_the_window_slides():
    # exits 400 s apart: never more than one other restart within 600 s, so --max-restarts 2 never runs out
    server = FakeServer(FakeProc(), step_s=400.0)
    w = watch(server, max_restarts=2)
    assert w.run(lambda: len(server.started) > 6, period_s=0) == ""
    assert w.restarts == 6


def test_a_failed_restart_counts_as_an_exit(caplog):
    server = FakeServer(
        FakeProc(returncode=1), fail=RuntimeError("tritonserver exited with code 1 before it was ready")
    )
    w = watch(server, max_restarts=3)
    with caplog.at_level(logging.INFO, logger="triton_disagg.server"):
        down = w.run(lambda: False, period_s=0)
    assert w.restarts == 3 and "(its restart failed) after 3 restarts" in down
    assert sum(r.getMessage().startswith("tritonserver restart ") for r in caplog.records) == 3


def test_zero_never_restarts():
    server = FakeServer(FakeProc(returncode=1))
    w = watch(server, max_restarts=0)
    assert (
        w.run(lambda: False, period_s=0)
        == "tritonserver exited unexpectedly (exit code 1); --max-restarts 0: not restarted"
    )
    assert w.restarts == 0 and len(server.started) == 1


def test_negative_values_are_refused_naming_the_setting(monkeypatch):
    with pytest.raises(ValueError, match="max_restarts must be >= 0"):
        RestartPolicy(max_restarts=-1)

    def must_not_start(args):
        raise AssertionError("a server started despite --max-restarts -1")

    monkeypatch.setattr(cli, "start_server", must_not_start)
    with pytest.raises(SystemExit, match=r"^--max-restarts: max_restarts must be >= 0 .* got -1$"):
        cli.main(["serve", "--max-restarts", "-1"])


def _serve(monkeypatch, server: FakeServer, *argv: str, handlers: dict | None = None) -> tuple[int, list]:
    """``cli.main(["serve", *argv])`` on ``server``: its exit code and its ``stop_server`` calls;
    ``handlers``: where the signal handlers it sets go."""
    frontend, stops, handlers = SimpleNamespace(url="http://127.0.0.1:9000"), [], {} if handlers is None else handlers
    monkeypatch.setattr(cli, "start_server", lambda args: (server, frontend))
    monkeypatch.setattr(cli, "stop_server", lambda *a: stops.append(a))
    monkeypatch.setattr(cli.signal, "signal", lambda sig, handler: handlers.update({sig: handler}))
    rc = cli.main(["serve", *argv])
    assert all(s[:2] == (server, frontend) for s in stops)
    return rc, stops


def test_serve_past_the_bound_stops_everything_and_exits_non_zero(monkeypatch, capsys):
    rc, stops = _serve(monkeypatch, FakeServer(FakeProc(returncode=-9)), "--max-restarts", "0")
    assert rc == 1 and len(stops) == 1
    err = capsys.readouterr().err
    assert "error: tritonserver exited unexpectedly (killed by signal 9 (SIGKILL)); --max-restarts 0" in err


def test_serve_sigterm_stops_without_a_restart(monkeypatch):
    handlers: dict = {}

    def sigterm():  # the server exits as serve's SIGTERM handler runs (a stop of both)
        handlers[cli.signal.SIGTERM]()

    server = FakeServer(FakeProc(lives=1, returncode=0, on_exit=sigterm))
    rc, stops = _serve(monkeypatch, server, "--drain-timeout", "7", handlers=handlers)
    assert rc == 0 and len(server.started) == 1 and len(stops) == 1 and stops[0][2] == 7.0
