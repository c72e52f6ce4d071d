"""The host agent (backend/autoscale/agent.py): starting, stopping and reporting its instances
(harmless stand-in processes instead of ``triton-disagg serve``), and its signed control API
served by uvicorn on a thread and called through ``AgentClient``. No etcd: it never registers."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from backend.autoscale.actuator import AUTH_HEADER, ActuatorError, AgentClient, sign
from backend.autoscale.agent import Agent, AgentConfig, app
from backend.cluster.records import InstanceRecord
from backend.launch.ports import free_port

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
FAIL = [sys.executable, "-c", "import sys; print('model file not found: /x', flush=True); sys.exit(3)"]


def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


@pytest.fixture
def make_agent(tmp_path, monkeypatch) -> Iterator[Callable[..., Agent]]:
    """An agent whose instances run ``cmd`` (set by each test), closed at the end."""
    secret_file = tmp_path / "secret"
    secret_file.write_text("ab" * 32 + "\n")
    agents: list[Agent] = []
    cmd = {"argv": SLEEP}
    monkeypatch.setattr(Agent, "command", lambda self, role, *ports: list(cmd["argv"]))

    def make(argv: list[str] = SLEEP, **changes) -> Agent:
        cmd["argv"] = argv
        config = AgentConfig(discovery="etcd://127.0.0.1:1", secret_file=str(secret_file), log_dir=str(tmp_path))
        for k, v in changes.items():
            setattr(config, k, v)
        agent = Agent(config)
        agents.append(agent)
        return agent

    make.cmd = cmd  # type: ignore[attr-defined]
    yield make
    for agent in agents:
        agent.close(timeout_s=5)


def test_start_gives_a_live_managed_instance_and_stop_ends_it(make_agent, tmp_path):
    agent = make_agent()
    assert agent.secret == b"ab" * 32
    m = agent.start("decode")
    assert (m.id, m.role, m.where) == ("decode-1", "decode", agent.name)
    assert m.alive and not m.stopping and m.exit_code is None
    host, port = m.grpc_url.rsplit(":", 1)
    assert host == "127.0.0.1" and 1024 <= int(port) < 65536
    assert abs(m.started_at - time.time()) < 10
    assert (tmp_path / "decode-1.log").exists()
    assert [x.id for x in agent.instances()] == ["decode-1"]

    stopped = agent.stop("decode-1")
    assert stopped.stopping
    assert wait_until(lambda: not agent.instances()[0].alive)
    after = agent.instances()[0]
    assert after.stopping and after.exit_code == -signal.SIGTERM
    # stopping again is harmless; an unknown id is not
    assert agent.stop("decode-1").exit_code == -signal.SIGTERM
    with pytest.raises(KeyError, match="no instance 'decode-9'"):
        agent.stop("decode-9")


def test_ids_count_up_per_agent(make_agent):
    agent = make_agent()
    assert [agent.start(r).id for r in ("prefill", "decode", "prefill")] == ["prefill-1", "decode-2", "prefill-3"]
    urls = [m.grpc_url for m in agent.instances()]
    assert len(set(urls)) == 3


def test_at_most_max_instances_run(make_agent):
    agent = make_agent(max_instances=1)
    agent.start("prefill")
    with pytest.raises(OverflowError, match="runs 1 instances, its maximum"):
        agent.start("decode")
    # once it has ended there is room again
    agent.stop("prefill-1")
    assert wait_until(lambda: not agent.instances()[0].alive)
    assert agent.start("decode").alive


def test_an_unknown_role_is_refused(make_agent):
    agent = make_agent()
    with pytest.raises(ValueError, match="role must be one of prefill, decode, got 'router'"):
        agent.start("router")
    assert agent.instances() == []


def test_an_exited_instance_shows_its_code_and_the_end_of_its_log(make_agent):
    agent = make_agent(FAIL)
    agent.start("prefill")
    assert wait_until(lambda: not agent.instances()[0].alive)
    m = agent.instances()[0]
    assert m.exit_code == 3 and not m.stopping
    assert "model file not found: /x" in m.detail
    # an exited one does not count against the maximum
    agent.config.max_instances = 1
    agent.start("prefill")


def test_close_stops_every_instance(make_agent):
    agent = make_agent()
    agent.start("prefill")
    agent.start("decode")
    procs = [ch.proc for ch in agent._children.values()]
    agent.close(timeout_s=5)
    assert all(p.poll() == -signal.SIGTERM for p in procs)
    assert all(m.stopping and not m.alive for m in agent.instances())


def test_the_command_runs_serve_for_one_instance_of_the_role(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("cd" * 32)
    config = AgentConfig(
        discovery="etcd://10.0.0.1:2379",
        secret_file=str(secret_file),
        deployment="prod",
        host="10.0.0.5",
        model="/models/tiny",
        sets=["max_num_seqs=8"],
        role_sets={"prefill": ["budget=512"]},
        log_dir=str(tmp_path),
    )
    agent = Agent(config)
    try:
        cmd = agent.command("prefill", 1, 2, 3, tmp_path / "prefill-1.log")
    finally:
        agent.close()
    joined = " ".join(cmd)
    assert cmd[:3] == [sys.executable, "-m", "backend.cli"]
    assert "serve --mode prefill --prefill-instances 1" in joined
    assert "--discovery etcd://10.0.0.1:2379 --deployment prod" in joined
    assert f"--deployment-secret-file {secret_file.resolve()}" in joined
    assert "--host 10.0.0.5 --messenger-host 10.0.0.5" in joined
    assert "--http-port 1 --grpc-port 2 --metrics-port 3" in joined
    assert "--model /models/tiny" in joined
    assert "--set max_num_seqs=8" in joined and "--prefill-set budget=512" in joined
    assert str(Path(tmp_path / "prefill-1.triton.log")) in joined


# the control API over HTTP


@pytest.fixture
def served(make_agent):
    """(agent, control URL) with the API served by uvicorn on a thread."""
    import uvicorn

    agent = make_agent(max_instances=2)
    port = free_port("127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(app(agent), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started or not thread.is_alive(), 10.0) and server.started
        yield agent, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(5)


def agent_record(url: str) -> InstanceRecord:
    return InstanceRecord("dep", "h-agent-1", "agent", "", "", "", "", "", 1, 1.0, False, "", url)


def test_the_client_lists_starts_and_stops_through_the_api(served):
    agent, url = served
    client = AgentClient(agent_record(url), agent.secret, timeout_s=5)
    assert client.instances() == []
    m = client.start("decode")
    assert m.alive and m.role == "decode" and m.where == agent.name
    assert client.instances() == [m]
    s = client.stop(m.id)
    assert s.id == m.id and s.stopping
    assert wait_until(lambda: not client.instances()[0].alive)
    # refusals come back as errors with their status
    with pytest.raises(ActuatorError, match="HTTP 400.*role must be one of"):
        client.start("router")
    with pytest.raises(ActuatorError, match="HTTP 404"):
        client.stop("decode-9")
    client.start("prefill")
    client.start("prefill")
    with pytest.raises(ActuatorError, match="HTTP 409.*its maximum"):
        client.start("prefill")


def test_the_api_refuses_unsigned_and_wrongly_signed_requests(served):
    agent, url = served
    resp = requests.get(url + "/instances", timeout=5)
    assert resp.status_code == 401 and "missing or malformed" in resp.json()["error"]
    resp = requests.post(url + "/instances", json={"role": "decode"}, timeout=5)
    assert resp.status_code == 401
    wrong = AgentClient(agent_record(url), b"ef" * 32, timeout_s=5)
    with pytest.raises(ActuatorError, match="HTTP 401"):
        wrong.start("decode")
    with pytest.raises(ActuatorError, match="HTTP 401"):
        wrong.instances()
    assert agent.instances() == []  # nothing was started
    # a recorded request cannot be replayed
    body = b'{"role": "decode"}'
    header = {AUTH_HEADER: sign(agent.secret, "POST", "/instances", body)}
    assert requests.post(url + "/instances", data=body, headers=header, timeout=5).status_code == 200
    again = requests.post(url + "/instances", data=body, headers=header, timeout=5)
    assert again.status_code == 401 and "replayed" in again.json()["error"]
    assert len(agent.instances()) == 1


def test_an_unreachable_agent_is_an_actuator_error():
    client = AgentClient(agent_record(f"http://127.0.0.1:{free_port()}"), b"ab" * 32, timeout_s=2)
    with pytest.raises(ActuatorError, match="agent h-agent-1 at http://127.0.0.1"):
        client.instances()
