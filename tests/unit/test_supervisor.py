"""The supervisor (``backend/launch/supervisor.py``) on a fake server: an instance whose stub
process ended is reloaded once, with the server log's tail in the error line; one that a scan of
the stub processes missed while its pid still runs is left alone (a reload would kill a stub that
serves, and its clients' streams with it). The reload through Triton's model-control API is
checked end to end by ``tests/integration/test_instances_come_back.py``."""

from __future__ import annotations

import logging
import threading

from backend.launch.supervisor import Supervisor


class FakeProc:
    def poll(self):
        return None


class FakeServer:
    """``scan``: what :meth:`instance_pids` answers; ``running``: the pids that still run."""

    def __init__(self, scan: dict[str, int]):
        self.proc = FakeProc()
        self.scan = dict(scan)
        self.running = set(scan.values())

    def instance_pids(self) -> dict[str, int]:
        return dict(self.scan)

    def stub_alive(self, pid: int) -> bool:
        return pid in self.running

    def log_tail(self, lines: int = 60) -> str:
        return "; the last 1 lines of tritonserver.log:\nFatal Python error: Segmentation fault"


def supervisor(server: FakeServer) -> tuple[Supervisor, list, threading.Event]:
    """A supervisor of ``server`` whose reloads are recorded (the list; the event: one ran)."""
    sup = Supervisor(server)
    sup._expected = server.instance_pids()
    reloads: list = []
    done = threading.Event()

    def reload(restart):
        reloads.append(restart)
        done.set()

    sup._reload = reload  # type: ignore[method-assign]
    return sup, reloads, done


def test_a_dead_stub_is_reloaded_once_with_the_log_tail(caplog):
    server = FakeServer({"llm_0_0": 10, "decode_0_0_0": 11})
    sup, reloads, done = supervisor(server)
    sup._check()
    assert reloads == []
    del server.scan["llm_0_0"]
    server.running.discard(10)
    with caplog.at_level(logging.ERROR, logger="triton_disagg.supervisor"):
        sup._check()
        assert done.wait(5)
        sup._check()  # the model is being reloaded: not a second time
    assert [(r.model, r.instances) for r in reloads] == [("llm", ["llm_0_0"])]
    (line,) = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert "llm_0_0 died" in line and "Segmentation fault" in line


def test_a_stub_missing_from_one_scan_but_running_is_not_reloaded():
    server = FakeServer({"llm_0_0": 10, "decode_0_0_0": 11})
    sup, reloads, _ = supervisor(server)
    del server.scan["llm_0_0"]  # the scan missed it; pid 10 still runs
    sup._check()
    server.scan["llm_0_0"] = 10
    sup._check()
    assert reloads == []
