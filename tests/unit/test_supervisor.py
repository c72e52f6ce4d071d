"""The supervisor (``backend/launch/supervisor.py``) on a fake server: an instance whose stub
process ended is reloaded once, with the server log's tail in the error line; one that a scan of
the stub processes missed while its pid still runs is left alone (a reload would kill a stub that
serves, and its clients' streams with it); a model that asks to be loaded again (a tensor-parallel
instance that lost a rank) is reloaded once, its reason logged. The reload through Triton's model-control API is
checked end to end by ``tests/integration/test_instances_come_back.py``."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from backend.launch.supervisor import Supervisor
from backend.triton.lifecycle import request_reload


class FakeProc:
    def poll(self):
        return None


class FakeServer:
    """``scan``: what :meth:`instance_pids` answers; ``running``: the pids that still run."""

    def __init__(self, scan: dict[str, int], repo: Path = Path("/nonexistent")):
        self.proc, self.repo = FakeProc(), repo
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


def test_a_model_that_asks_to_be_loaded_again_is_reloaded_once_with_its_reason(tmp_path, caplog):
    server = FakeServer({"decode_0_0_0": 11, "prefill_0_0_0": 12}, repo=tmp_path)
    sup, reloads, done = supervisor(server)
    reason = "tensor-parallel instance out of service: rank 1 (pid 99) exited (signal 9)"
    request_reload(str(tmp_path / "decode_0"), "decode_0", reason)  # what the model does (its directory)
    with caplog.at_level(logging.ERROR, logger="triton_disagg.supervisor"):
        sup._check()
        assert done.wait(5)
        request_reload(str(tmp_path / "decode_0"), "decode_0", reason)  # asked again while it reloads
        sup._check()
    assert [(r.model, r.instances, r.reason) for r in reloads] == [("decode_0", ["decode_0_0_0"], reason)]
    assert not list(tmp_path.iterdir())  # both requests answered: no reload of the new instance later
    (line,) = [r.getMessage() for r in caplog.records if "asked to be loaded again" in r.getMessage()]
    assert reason in line
