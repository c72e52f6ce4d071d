"""One interval of the autoscaler (backend/autoscale/autoscaler.py ``Autoscaler.step``) with a
fake membership, a fake actuator and made-up scrapes: bringing a deployment to its minimum,
instances that are starting, that never joined or that exited, which instance a scale-in
drains, draining records, the decisions file and the /metrics text. No HTTP, no etcd."""

from __future__ import annotations

import itertools
import json
import math
import time

import pytest

from backend.autoscale import autoscaler as autoscaler_mod
from backend.autoscale.actuator import ActuatorError, Managed
from backend.autoscale.autoscaler import Autoscaler
from backend.autoscale.policy import Policy, PolicyConfig
from backend.autoscale.signals import Scrape
from backend.cluster.prometheus_text import samples
from backend.cluster.records import InstanceRecord
from backend.planner.slo import SLO


def record(role: str, i: int, draining: bool = False, metrics: bool = True) -> InstanceRecord:
    return InstanceRecord(
        "dep",
        f"h:{role}_{i}:1",
        role,
        f"h:{8000 + i if role == 'prefill' else 9000 + i}",
        f"{role}_{i}",
        "h:7000" if role == "prefill" else "",
        "id",
        "layout",
        1,
        1.0,
        draining,
        f"http://h:{role}{i}/metrics" if metrics else "",
    )


_PORTS = itertools.count(20000)


def managed(rec: InstanceRecord | None, iid: str, role: str = "decode", **changes) -> Managed:
    fields = dict(
        id=iid,
        role=role,
        where="agent-a",
        grpc_url=rec.grpc_url if rec else f"h:{next(_PORTS)}",  # one no record has
        alive=True,
        stopping=False,
        started_at=time.time(),
    )
    fields.update(changes)
    return Managed(**fields)


class FakeMembership:
    def __init__(self, records: list[InstanceRecord]):
        self.records = records

    def members(self, role: str | None = None) -> list[InstanceRecord]:
        return [r for r in self.records if role is None or r.role == role]


class FakeActuator:
    name = "fake"

    def __init__(self, held: list[Managed] | None = None):
        self.held = list(held or [])
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.failed: list[str] = []
        self.refuse = False

    def managed(self) -> list[Managed]:
        return list(self.held)

    def start(self, role: str) -> Managed:
        self.started.append(role)
        if self.refuse:
            raise ActuatorError("no agent could start it")
        m = managed(None, f"{role}-new-{len(self.started)}", role)
        self.held.append(m)
        return m

    def stop(self, m: Managed) -> None:
        self.stopped.append(m.id)

    def start_failed(self, where: str) -> None:
        self.failed.append(where)


@pytest.fixture
def scrapes(monkeypatch):
    """Model name -> Scrape that the (patched) ``scrape`` hands back; the URLs it was asked for."""
    table: dict[str, Scrape] = {}
    asked: list[str] = []

    def fake_scrape(url: str, models: list[str], timeout_s: float = 2.0) -> dict[str, Scrape]:
        asked.append(url)
        if url.endswith("/down/metrics"):
            raise OSError("connection refused")
        return {m: table.get(m, Scrape()) for m in models}

    monkeypatch.setattr(autoscaler_mod, "scrape", fake_scrape)
    return table, asked


def config(**changes) -> PolicyConfig:
    kw = dict(slo=SLO(1.0, 0.1), min_instances={"prefill": 1, "decode": 1}, max_instances={"prefill": 3, "decode": 3})
    kw.update(changes)
    return PolicyConfig(**kw)


def test_first_step_starts_the_minimum_and_writes_the_decisions(scrapes, tmp_path):
    act = FakeActuator()
    path = tmp_path / "decisions.jsonl"
    a = Autoscaler(FakeMembership([]), act, Policy(config()), decisions_file=path)
    rec = a.step()
    assert act.started == ["prefill", "decode"]
    assert rec.current == {"prefill": 0, "decode": 0}
    assert [(d["role"], d["current"], d["desired"]) for d in rec.decisions] == [("prefill", 0, 1), ("decode", 0, 1)]
    assert any(x.startswith("started prefill prefill-new-1") for x in rec.actions)
    assert any(x.startswith("started decode decode-new-2") for x in rec.actions)
    assert a.desired == {"prefill": 1, "decode": 1}
    # the started ones now count as starting: no second start
    rec = a.step()
    assert act.started == ["prefill", "decode"]
    assert rec.starting == {"prefill": 1, "decode": 1} and rec.current == {"prefill": 1, "decode": 1}
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 2
    assert lines[0]["current"] == {"prefill": 0, "decode": 0}
    assert lines[0]["decisions"][1]["reason"] == "below the minimum of 1"
    assert lines[1]["starting"] == {"prefill": 1, "decode": 1}
    assert lines[1]["actions"] == []
    # NaN figures are written as null (valid JSON)
    assert lines[1]["observed"]["decode"]["ttft_p90_s"] is None
    assert "NaN" not in path.read_text()


def test_a_failed_start_is_recorded_and_not_counted(scrapes):
    act = FakeActuator()
    act.refuse = True
    a = Autoscaler(FakeMembership([]), act, Policy(config()))
    rec = a.step()
    assert act.started == ["prefill", "decode"]
    assert any("start of a decode instance failed: no agent could start it" in x for x in rec.actions)
    # nothing was changed: the next interval tries again
    act.refuse = False
    a.step()
    assert act.started == ["prefill", "decode", "prefill", "decode"]


def test_a_managed_instance_not_yet_in_the_membership_counts_as_starting(scrapes):
    serving = [record("prefill", 0), record("decode", 0)]
    act = FakeActuator([managed(None, "decode-1")])
    a = Autoscaler(FakeMembership(serving), act, Policy(config(min_instances={"prefill": 1, "decode": 2})))
    rec = a.step()
    assert rec.starting == {"prefill": 0, "decode": 1}
    assert rec.current == {"prefill": 1, "decode": 2}
    assert act.started == [] and act.stopped == []


def test_an_instance_that_never_joined_is_stopped_and_reported(scrapes):
    serving = [record("prefill", 0), record("decode", 0)]
    late = managed(None, "decode-1", started_at=time.time() - 500, where="agent-b")
    act = FakeActuator([late])
    a = Autoscaler(
        FakeMembership(serving), act, Policy(config(min_instances={"prefill": 1, "decode": 2})), start_timeout_s=240.0
    )
    rec = a.step()
    assert act.stopped == ["decode-1"]
    assert act.failed == ["agent-b"]
    assert rec.starting["decode"] == 0
    # below the minimum of 2 decode instances without it: a replacement is started
    assert act.started == ["decode"]


def test_an_exited_instance_is_reported_once(scrapes):
    serving = [record("prefill", 0), record("decode", 0)]
    dead = managed(None, "decode-1", alive=False, exit_code=3, detail="Traceback ...", where="agent-c")
    act = FakeActuator([dead])
    a = Autoscaler(FakeMembership(serving), act, Policy(config()))
    rec = a.step()
    assert act.failed == ["agent-c"]
    assert rec.starting == {"prefill": 0, "decode": 0}
    assert act.stopped == []
    a.step()
    assert act.failed == ["agent-c"]  # reported once


def test_scale_in_drains_the_managed_serving_instance_with_fewest_requests(scrapes):
    table, _ = scrapes
    serving = [record("prefill", 0)] + [record("decode", i) for i in range(3)]
    table.update(
        {
            "decode_0": Scrape({"requests_active": 5.0}),
            "decode_1": Scrape({"requests_active": 1.0}),
            "decode_2": Scrape({"requests_active": 0.0}),  # fewest, but not managed
        }
    )
    act = FakeActuator([managed(serving[1], "d0"), managed(serving[2], "d1"), managed(serving[0], "p0", "prefill")])
    a = Autoscaler(FakeMembership(serving), act, Policy(config(scale_in_intervals=1, cooldown_s=0.0)))
    rec = a.step()
    assert rec.current == {"prefill": 1, "decode": 3}
    assert act.stopped == ["d1"]
    assert any(x.startswith("draining decode d1 on agent-a (1 requests in flight)") for x in rec.actions)
    assert a.desired == {"prefill": 1, "decode": 2}


def test_scale_in_without_a_managed_instance_says_so(scrapes):
    serving = [record("prefill", 0)] + [record("decode", i) for i in range(2)]
    act = FakeActuator()
    a = Autoscaler(FakeMembership(serving), act, Policy(config(scale_in_intervals=1, cooldown_s=0.0)))
    rec = a.step()
    assert act.stopped == []
    assert "no decode instance managed by fake to stop" in rec.actions


def test_a_draining_record_is_not_counted(scrapes):
    table, asked = scrapes
    serving = [record("prefill", 0), record("decode", 0), record("decode", 1, draining=True)]
    act = FakeActuator()
    a = Autoscaler(FakeMembership(serving), act, Policy(config(min_instances={"prefill": 1, "decode": 2})))
    rec = a.step()
    assert rec.current == {"prefill": 1, "decode": 1}
    assert act.started == ["decode"]  # below the minimum of 2 without the draining one
    assert "http://h:decode1/metrics" not in asked
    assert "http://h:decode0/metrics" in asked


def test_the_interval_is_observed_from_two_scrapes(scrapes, monkeypatch):
    table, _ = scrapes
    serving = [record("prefill", 0), record("decode", 0)]
    table["decode_0"] = Scrape({"requests_total": 100.0, "requests_active": 2.0})
    clock = iter([1000.0, 1010.0])
    monkeypatch.setattr(autoscaler_mod.time, "monotonic", lambda: next(clock))
    a = Autoscaler(FakeMembership(serving), FakeActuator(), Policy(config()))
    first = a.step()
    assert first.observed["decode"]["interval_s"] == 0.0
    table["decode_0"] = Scrape({"requests_total": 150.0, "requests_active": 2.0})
    second = a.step()
    assert second.observed["decode"]["interval_s"] == pytest.approx(10.0)
    assert second.observed["decode"]["arrivals_per_s"] == pytest.approx(5.0)
    # the predictor saw it
    assert second.predicted_load["arrivals_per_s"] == pytest.approx(5.0)


def test_an_unreachable_metrics_endpoint_does_not_stop_the_interval(scrapes):
    table, asked = scrapes
    down = InstanceRecord(
        "dep", "h:decode_9:1", "decode", "h:9009", "decode_9", "", "id", "l", 1, 1.0, False, "http://h/down/metrics"
    )
    serving = [record("prefill", 0), record("decode", 0), down, record("decode", 1, metrics=False)]
    a = Autoscaler(FakeMembership(serving), FakeActuator(), Policy(config()))
    rec = a.step()
    assert "http://h/down/metrics" in asked
    assert rec.current["decode"] == 3
    assert rec.observed["decode"]["instances"] == 1  # only decode_0 was read


DIRECTION_UP = {r: {"role": r, "direction": "up"}.items() for r in ("prefill", "decode")}


def test_exposition_has_desired_and_actual_per_role(scrapes):
    a = Autoscaler(FakeMembership([]), FakeActuator(), Policy(config()))
    before = a.exposition()
    assert 'triton_disagg_autoscaler_desired_instances{role="decode"} 0.0' in before
    a.step()
    text = a.exposition()
    for role in ("prefill", "decode"):
        assert f'triton_disagg_autoscaler_desired_instances{{role="{role}"}} 1.0' in text
        assert f'triton_disagg_autoscaler_actual_instances{{role="{role}"}} 0.0' in text
        assert f'triton_disagg_autoscaler_starting_instances{{role="{role}"}} 0.0' in text
        # (label order is not part of a series: prometheus_client writes them sorted)
        assert samples(text)[("triton_disagg_autoscaler_decisions_total", frozenset(DIRECTION_UP[role]))] == 1.0
    assert "# TYPE triton_disagg_autoscaler_desired_instances gauge" in text
    assert 'triton_disagg_autoscaler_observed{figure="ttft_p90_s"} NaN' in text
    assert 'triton_disagg_autoscaler_predicted{figure="arrivals_per_s"} 0.0' in text
    # every sample line is name{labels} value
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert lines and all(line.startswith("triton_disagg_autoscaler_") for line in lines)
    assert all(not math.isinf(float(line.rsplit(" ", 1)[1])) for line in lines)


def test_an_actuator_that_cannot_list_its_instances_changes_nothing(scrapes):
    """Its starting instances are unknown: a start now could start them twice."""

    class Unlisted(FakeActuator):
        def managed(self) -> list[Managed]:
            raise ActuatorError("agent a at http://h:1: connection refused")

    act = Unlisted()
    rec = Autoscaler(FakeMembership([]), act, Policy(config())).step()
    assert act.started == [] and act.stopped == []
    assert [(d["current"], d["desired"]) for d in rec.decisions] == [(0, 0), (0, 0)]
    assert all("unknown" in d["reason"] for d in rec.decisions)
