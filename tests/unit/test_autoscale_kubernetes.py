"""The Kubernetes actuator against fake AppsV1Api / CoreV1Api objects that record the calls and
answer with the client's own model objects (no cluster, no network)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from backend.autoscale import kubernetes as k8s
from backend.autoscale.actuator import ActuatorError, Managed

NS = "serving"
DEPLOYMENTS = {"prefill": "td-prefill", "decode": "td-decode"}
SELECTORS = {"td-prefill": {"app": "td", "role": "prefill"}, "td-decode": {"role": "decode", "app": "td"}}
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


class FakeApps:
    """Records calls in ``log``; ``replicas`` per Deployment; ``fail`` maps a method to an error."""

    def __init__(self, log: list, replicas: dict[str, int]):
        self.log, self.replicas, self.fail = log, replicas, {}

    def _call(self, method: str, *args) -> None:
        self.log.append((method, *args))
        if method in self.fail:
            raise self.fail[method]

    def read_namespaced_deployment_scale(self, name: str, namespace: str) -> client.V1Scale:
        self._call("read_scale", name, namespace)
        return client.V1Scale(spec=client.V1ScaleSpec(replicas=self.replicas[name]))

    def patch_namespaced_deployment_scale(self, name: str, namespace: str, body: dict) -> client.V1Scale:
        self._call("patch_scale", name, namespace, body)
        self.replicas[name] = body["spec"]["replicas"]
        return client.V1Scale(spec=client.V1ScaleSpec(replicas=self.replicas[name]))

    def read_namespaced_deployment(self, name: str, namespace: str) -> client.V1Deployment:
        self._call("read_deployment", name, namespace)
        selector = client.V1LabelSelector(match_labels=SELECTORS[name])
        return client.V1Deployment(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace),
            spec=client.V1DeploymentSpec(selector=selector, template=client.V1PodTemplateSpec()),
        )


class FakeCore:
    """Records calls in ``log``; ``pods`` per label selector."""

    def __init__(self, log: list, pods: dict[str, list[client.V1Pod]]):
        self.log, self.pods, self.fail = log, pods, {}

    def list_namespaced_pod(self, namespace: str, label_selector: str) -> client.V1PodList:
        self.log.append(("list_pods", namespace, label_selector))
        if "list_pods" in self.fail:
            raise self.fail["list_pods"]
        return client.V1PodList(items=self.pods.get(label_selector, []))

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict) -> client.V1Pod:
        self.log.append(("patch_pod", name, namespace, body))
        if "patch_pod" in self.fail:
            raise self.fail["patch_pod"]
        return client.V1Pod(metadata=client.V1ObjectMeta(name=name))


def pod(
    name: str,
    phase: str = "Running",
    ip: str | None = "10.0.0.1",
    ready: bool = True,
    deleting: bool = False,
    started: datetime | None = T0,
) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=name, creation_timestamp=datetime(2026, 1, 1, tzinfo=UTC), deletion_timestamp=T0 if deleting else None
        ),
        spec=client.V1PodSpec(containers=[client.V1Container(name="serve")], node_name="node-1" if ip else None),
        status=client.V1PodStatus(
            phase=phase,
            pod_ip=ip,
            start_time=started,
            conditions=[client.V1PodCondition(type="Ready", status="True" if ready else "False")],
        ),
    )


PREFILL_SEL, DECODE_SEL = "app=td,role=prefill", "app=td,role=decode"


def make(replicas: dict[str, int] | None = None, pods: dict[str, list] | None = None):
    log: list = []
    apps = FakeApps(log, replicas or {"td-prefill": 1, "td-decode": 2})
    core = FakeCore(log, pods or {})
    return k8s.KubernetesActuator(NS, DEPLOYMENTS, grpc_port=8101, apps_api=apps, core_api=core), apps, core, log


def managed(name: str, role: str = "decode", where: str = "td-decode") -> Managed:
    return Managed(
        id=name, role=role, where=where, grpc_url="10.0.0.1:8101", alive=True, stopping=False, started_at=0.0
    )


def test_start_scales_the_roles_deployment_out_by_one():
    act, apps, _, log = make()
    m = act.start("decode")
    assert log == [("read_scale", "td-decode", NS), ("patch_scale", "td-decode", NS, {"spec": {"replicas": 3}})]
    assert apps.replicas == {"td-prefill": 1, "td-decode": 3}
    assert (m.id, m.role, m.where, m.grpc_url, m.alive, m.stopping) == (
        "td-decode/replica-3",
        "decode",
        "td-decode",
        "",
        False,
        False,
    )
    assert act.name == "kubernetes"


def test_start_of_a_role_without_deployment_is_refused():
    log: list = []
    act = k8s.KubernetesActuator(NS, {"prefill": "td-prefill"}, apps_api=FakeApps(log, {}), core_api=FakeCore(log, {}))
    with pytest.raises(ActuatorError, match="decode"):
        act.start("decode")
    assert log == []


def test_managed_maps_each_pod_found_by_the_selector():
    evicted = pod("p-evicted", phase="Failed", ip="10.0.0.5", ready=False)
    evicted.status.reason = "Evicted"
    terminated = client.V1ContainerStateTerminated(exit_code=137, reason="Error")
    evicted.status.container_statuses = [
        client.V1ContainerStatus(
            name="serve",
            image="td",
            image_id="",
            ready=False,
            restart_count=0,
            state=client.V1ContainerState(terminated=terminated),
        )
    ]
    pods = {
        DECODE_SEL: [
            pod("d-run", ip="10.0.0.7"),
            pod("d-term", ip="10.0.0.8", deleting=True),
            pod("d-pend", phase="Pending", ip=None, ready=False, started=None),
        ],
        PREFILL_SEL: [pod("p-run", ip="10.0.0.9"), evicted],
    }
    act, _, _, log = make(pods=pods)
    got = {m.id: m for m in act.managed()}
    assert ("list_pods", NS, DECODE_SEL) in log and ("list_pods", NS, PREFILL_SEL) in log
    assert ("read_deployment", "td-decode", NS) in log
    assert set(got) == {"d-run", "d-term", "d-pend", "p-run", "p-evicted"}
    run, term, pend = got["d-run"], got["d-term"], got["d-pend"]
    assert (run.role, run.where, run.grpc_url, run.alive, run.stopping) == (
        "decode",
        "td-decode",
        "10.0.0.7:8101",
        True,
        False,
    )
    assert run.started_at == T0.timestamp()
    assert (term.grpc_url, term.alive, term.stopping) == ("10.0.0.8:8101", False, True)
    assert "terminating" in term.detail
    # alive: coming, not exited (the autoscaler counts it as starting until it joins the membership)
    assert (pend.grpc_url, pend.alive, pend.stopping, pend.exit_code) == ("", True, False, None)
    assert pend.started_at == datetime(2026, 1, 1, tzinfo=UTC).timestamp()  # creation time, not started yet
    assert (got["p-run"].role, got["p-run"].where) == ("prefill", "td-prefill")
    failed = got["p-evicted"]
    assert (failed.alive, failed.stopping, failed.exit_code) == (False, False, 137)
    assert failed.detail == "Failed Evicted Error"


def test_label_selector_renders_labels_and_expressions():
    req = client.V1LabelSelectorRequirement
    selector = client.V1LabelSelector(
        match_labels={"b": "2", "a": "1"},
        match_expressions=[
            req(key="tier", operator="In", values=["x", "y"]),
            req(key="zone", operator="NotIn", values=["z"]),
            req(key="gpu", operator="Exists"),
            req(key="old", operator="DoesNotExist"),
        ],
    )
    assert k8s.label_selector(selector) == "a=1,b=2,tier in (x,y),zone notin (z),gpu,!old"
    assert k8s.label_selector(None) == ""


def test_stop_marks_that_pod_cheapest_then_scales_in_by_one():
    act, apps, _, log = make(pods={DECODE_SEL: [pod("d-0"), pod("d-1", ip="10.0.0.2")]})
    act.stop(managed("d-1"))
    writes = [c for c in log if c[0].startswith("patch")]
    assert writes == [
        ("patch_pod", "d-1", NS, {"metadata": {"annotations": {k8s.DELETION_COST: "-1000"}}}),
        ("patch_scale", "td-decode", NS, {"spec": {"replicas": 1}}),
    ]
    assert apps.replicas["td-decode"] == 1


def test_stop_never_scales_below_zero():
    act, apps, _, log = make(replicas={"td-prefill": 0, "td-decode": 0}, pods={PREFILL_SEL: [pod("p-0")]})
    act.stop(managed("p-0", role="prefill", where="td-prefill"))
    assert log[-1] == ("patch_scale", "td-prefill", NS, {"spec": {"replicas": 0}})
    assert apps.replicas["td-prefill"] == 0


def test_stop_refuses_while_another_pod_would_be_removed_first():
    starting = pod("d-new", phase="Pending", ip=None, ready=False)
    act, apps, _, log = make(pods={DECODE_SEL: [pod("d-0"), starting]})
    with pytest.raises(ActuatorError, match="d-new"):
        act.stop(managed("d-0"))
    assert not [c for c in log if c[0].startswith("patch")]
    assert apps.replicas["td-decode"] == 2


def test_stop_of_a_terminating_pod_does_nothing_and_an_unknown_pod_is_refused():
    act, _, _, log = make(pods={DECODE_SEL: [pod("d-0", deleting=True), pod("d-1")]})
    act.stop(managed("d-0"))
    assert not [c for c in log if c[0].startswith("patch")]
    with pytest.raises(ActuatorError, match="no pod d-9"):
        act.stop(managed("d-9"))
    with pytest.raises(ActuatorError, match="td-other"):
        act.stop(managed("d-1", where="td-other"))
    assert not [c for c in log if c[0].startswith("patch")]


def test_api_errors_become_actuator_errors_naming_the_deployment():
    forbidden = ApiException(status=403, reason="Forbidden")
    act, apps, core, log = make(pods={DECODE_SEL: [pod("d-0")]})
    apps.fail["patch_scale"] = forbidden
    with pytest.raises(ActuatorError, match=r"td-prefill.*403 Forbidden"):
        act.start("prefill")

    core.fail["list_pods"] = forbidden
    with pytest.raises(ActuatorError, match=r"td-(prefill|decode).*403 Forbidden"):
        act.managed()

    del core.fail["list_pods"]
    core.fail["patch_pod"] = forbidden
    log.clear()
    with pytest.raises(ActuatorError, match=r"d-0.*403 Forbidden"):
        act.stop(managed("d-0"))
    assert not [c for c in log if c[0] == "patch_scale"]  # no scale-in when the pod could not be chosen


def test_parse_deployments():
    assert k8s.parse_deployments("prefill=td-prefill, decode=td-decode") == DEPLOYMENTS
    with pytest.raises(ValueError, match="'router'"):
        k8s.parse_deployments("prefill=a,router=b")
    with pytest.raises(ValueError, match="ROLE=DEPLOYMENT"):
        k8s.parse_deployments("prefill")
    with pytest.raises(ValueError, match="twice"):
        k8s.parse_deployments("decode=a,decode=b")
    with pytest.raises(ValueError, match="router"):
        k8s.KubernetesActuator(NS, {"router": "x"}, apps_api=object(), core_api=object())


def test_from_args_loads_the_kubeconfig_when_not_in_a_cluster(monkeypatch):
    calls = []

    def not_in_cluster(*a, **kw):
        calls.append("incluster")
        raise config.ConfigException("not in a cluster")

    monkeypatch.setattr(config, "load_incluster_config", not_in_cluster)
    monkeypatch.setattr(config, "load_kube_config", lambda *a, **kw: calls.append("kubeconfig"))
    act = k8s.KubernetesActuator.from_args(NS, "decode=td-decode", grpc_port=9001)
    assert calls == ["incluster", "kubeconfig"]
    assert isinstance(act.apps, client.AppsV1Api) and isinstance(act.core, client.CoreV1Api)
    assert (act.deployments, act.grpc_port) == ({"decode": "td-decode"}, 9001)

    def no_kubeconfig(*a, **kw):
        raise config.ConfigException("Invalid kube-config file. No configuration found.")

    monkeypatch.setattr(config, "load_kube_config", no_kubeconfig)
    with pytest.raises(ActuatorError, match="kubeconfig"):
        k8s.KubernetesActuator(NS, {"decode": "td-decode"})
