"""The Kubernetes actuator: the autoscaler scales one Deployment per role (prefill, decode) through
the official ``kubernetes`` client. A start raises the role's Deployment by one replica; a stop
picks exactly the pod to remove (it lowers that pod's ``controller.kubernetes.io/pod-deletion-cost``
to -1000, so the ReplicaSet controller removes it first; on by default since Kubernetes 1.22),
then lowers the replicas by one. The pod gets SIGTERM and ``triton-disagg serve`` drains.
The instances it manages are the pods its Deployments' selectors match, each matched with its
membership record by its gRPC address ``POD_IP:GRPC_PORT``; a pod is alive (pending, then
running) until it ends or is terminating.

Tested: unit tests against the client's own model objects (``V1Scale``, ``V1Deployment``,
``V1PodList``, ``V1Pod`` ...) served by fake API objects (``tests/unit/test_autoscale_kubernetes.py``).
Not tested: a run against a real cluster (API server, RBAC, the ReplicaSet controller's choice).

What it needs from the cluster:

* RBAC, in the Deployments' namespace, for the autoscaler's service account: ``deployments/scale``
  get and patch, ``deployments`` get, ``pods`` list and patch (apps and core API groups).
* The pod spec: ``terminationGracePeriodSeconds`` above the serve process's ``--drain-timeout``
  (default 30 s), or the pod is killed mid-drain; the container runs
  ``triton-disagg serve --mode prefill|decode --discovery etcd://... --deployment-secret-file ...
  --host 0.0.0.0 --messenger-host $(POD_IP)`` (``POD_IP`` from the downward API,
  ``status.podIP``), its Triton gRPC port the ``grpc_port`` given here.

Limits: the controller ranks pods before their deletion cost by being scheduled, their phase and
readiness, so a stop is refused (``ActuatorError``) while another pod of the Deployment is less
far along than the chosen one (it would be removed instead). During a rollout the Deployment
controller decides which ReplicaSet shrinks. Replica counts are read, then patched: one
autoscaler per Deployment.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from backend.autoscale.actuator import ActuatorError, Managed

if TYPE_CHECKING:
    from kubernetes.client import AppsV1Api, CoreV1Api, V1LabelSelector, V1Pod

log = logging.getLogger("triton_disagg.autoscale")

ROLES = ("prefill", "decode")
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
STOP_DELETION_COST = "-1000"
_PHASE_RANK = {"Pending": 0, "Unknown": 1, "Running": 2}


def parse_deployments(text: str) -> dict[str, str]:
    """``"prefill=td-prefill,decode=td-decode"`` -> ``{"prefill": "td-prefill", "decode": "td-decode"}``;
    ``ValueError`` naming the fault (an unknown or repeated role, a missing name)."""
    out: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        role, sep, name = (s.strip() for s in item.partition("="))
        if not sep or not name:
            raise ValueError(f"{item!r}: expected ROLE=DEPLOYMENT")
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} in {item!r} (roles: {', '.join(ROLES)})")
        if role in out:
            raise ValueError(f"role {role!r} given twice")
        out[role] = name
    if not out:
        raise ValueError(f"no ROLE=DEPLOYMENT in {text!r}")
    return out


def label_selector(selector: V1LabelSelector | None) -> str:
    """A Deployment's ``spec.selector`` as a label-selector string (``app=x,tier in (a,b)``)."""
    parts = [f"{k}={v}" for k, v in sorted((selector.match_labels or {}).items())] if selector else []
    for req in (selector.match_expressions or []) if selector else []:
        op, values = req.operator, ",".join(req.values or [])
        if op == "In":
            parts.append(f"{req.key} in ({values})")
        elif op == "NotIn":
            parts.append(f"{req.key} notin ({values})")
        elif op == "Exists":
            parts.append(req.key)
        elif op == "DoesNotExist":
            parts.append(f"!{req.key}")
        else:
            raise ActuatorError(f"unsupported label-selector operator {op!r}")
    return ",".join(parts)


@contextmanager
def _api_call(what: str) -> Iterator[None]:
    """Turn the client's ``ApiException`` into an ``ActuatorError`` saying what failed and why."""
    from kubernetes.client.exceptions import ApiException

    try:
        yield
    except ApiException as e:
        raise ActuatorError(f"kubernetes: {what}: HTTP {e.status} {e.reason}") from None


def _load_apis() -> tuple[AppsV1Api, CoreV1Api]:
    """The in-cluster service account's APIs, else those of the local kubeconfig."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as e:
            raise ActuatorError(f"kubernetes: no in-cluster config and no usable kubeconfig: {e}") from None
    return client.AppsV1Api(), client.CoreV1Api()


def _ready(pod: V1Pod) -> bool:
    conditions = (pod.status.conditions if pod.status else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _rank(pod: V1Pod) -> tuple[bool, int, bool]:
    """How far along a pod is, in the order the ReplicaSet controller removes pods before it looks
    at their deletion cost: unscheduled, then by phase, then not ready (lower goes first)."""
    phase = pod.status.phase if pod.status else None
    return (bool(pod.spec and pod.spec.node_name), _PHASE_RANK.get(phase or "Pending", 0), _ready(pod))


class KubernetesActuator:
    """Scales one Deployment per role (``deployments``: role -> Deployment name) in ``namespace``;
    ``apps_api`` / ``core_api`` default to the client's ``AppsV1Api`` / ``CoreV1Api``."""

    name = "kubernetes"

    def __init__(
        self,
        namespace: str,
        deployments: dict[str, str],
        grpc_port: int = 8001,
        apps_api: AppsV1Api | None = None,
        core_api: CoreV1Api | None = None,
    ):
        unknown = sorted(set(deployments) - set(ROLES))
        if unknown:
            raise ValueError(f"unknown role(s) {', '.join(unknown)} (roles: {', '.join(ROLES)})")
        if not deployments:
            raise ValueError("no Deployment given for any role")
        self.namespace, self.deployments, self.grpc_port = namespace, dict(deployments), grpc_port
        if apps_api is None or core_api is None:
            apps, core = _load_apis()
            apps_api, core_api = apps_api or apps, core_api or core
        self.apps, self.core = apps_api, core_api

    @classmethod
    def from_args(cls, namespace: str, text: str, grpc_port: int = 8001) -> KubernetesActuator:
        """From CLI text such as ``"prefill=td-prefill,decode=td-decode"``."""
        return cls(namespace, parse_deployments(text), grpc_port)

    def _deployment(self, role: str) -> str:
        try:
            return self.deployments[role]
        except KeyError:
            raise ActuatorError(f"no Deployment configured for role {role!r}") from None

    def _replicas(self, deployment: str) -> int:
        with _api_call(f"read the scale of deployment {self.namespace}/{deployment}"):
            scale = self.apps.read_namespaced_deployment_scale(deployment, self.namespace)
        return (scale.spec.replicas if scale.spec else None) or 0

    def _scale(self, deployment: str, replicas: int) -> None:
        with _api_call(f"scale deployment {self.namespace}/{deployment} to {replicas}"):
            self.apps.patch_namespaced_deployment_scale(deployment, self.namespace, {"spec": {"replicas": replicas}})

    def _pods(self, deployment: str) -> list[V1Pod]:
        with _api_call(f"read deployment {self.namespace}/{deployment}"):
            dep = self.apps.read_namespaced_deployment(deployment, self.namespace)
        selector = label_selector(dep.spec.selector if dep.spec else None)
        if not selector:
            raise ActuatorError(f"deployment {self.namespace}/{deployment} has an empty selector")
        with _api_call(f"list the pods of deployment {self.namespace}/{deployment}"):
            return list(self.core.list_namespaced_pod(self.namespace, label_selector=selector).items)

    def _managed(self, role: str, deployment: str, pod: V1Pod) -> Managed:
        """A pod as an instance: alive unless it ended (Succeeded, Failed) or is terminating, since
        the autoscaler takes an instance that is not alive for one that exited; a pending pod is
        alive and starting until its record joins the membership."""
        meta, status = pod.metadata, pod.status
        terminating = meta is not None and meta.deletion_timestamp is not None
        phase = (status.phase if status else None) or "Pending"
        ended = phase in ("Succeeded", "Failed")
        ip = status.pod_ip if status else None
        started = (status.start_time if status else None) or (meta.creation_timestamp if meta else None)
        reasons = [status.reason] if status and status.reason else []
        exit_code = None
        for c in (status.container_statuses if status else None) or []:
            if c.state and c.state.waiting and c.state.waiting.reason:
                reasons.append(c.state.waiting.reason)
            if ended and c.state and c.state.terminated and exit_code is None:
                exit_code = c.state.terminated.exit_code
                reasons.append(c.state.terminated.reason or "")
        return Managed(
            id=(meta.name if meta else None) or "",
            role=role,
            where=deployment,
            grpc_url=f"{ip}:{self.grpc_port}" if ip else "",
            alive=not ended and not terminating,
            stopping=terminating,
            started_at=started.timestamp() if started else 0.0,
            exit_code=exit_code,
            detail=" ".join(filter(None, [phase, "terminating" if terminating else "", *reasons])),
        )

    def managed(self) -> list[Managed]:
        """The pods of every role's Deployment; ``ActuatorError`` when one cannot be listed."""
        return [
            self._managed(role, deployment, pod)
            for role, deployment in self.deployments.items()
            for pod in self._pods(deployment)
        ]

    def start(self, role: str) -> Managed:
        """One more replica of the role's Deployment; the result stands for the pod to come."""
        deployment = self._deployment(role)
        n = self._replicas(deployment)
        self._scale(deployment, n + 1)
        log.info("autoscale: scaled deployment %s/%s to %d (%s)", self.namespace, deployment, n + 1, role)
        return Managed(
            id=f"{deployment}/replica-{n + 1}",
            role=role,
            where=deployment,
            grpc_url="",
            alive=False,
            stopping=False,
            started_at=time.time(),
        )

    def start_failed(self, where: str) -> None:
        """Nothing to prefer instead: the scheduler places pods (a pod that failed is logged)."""
        log.warning("autoscale: a pod of Deployment %s ended or never joined the membership", where)

    def stop(self, instance: Managed) -> None:
        """Scale the instance's Deployment in by one, removing exactly the instance's pod (drained
        by its serve process on SIGTERM); nothing to do when the pod is already terminating."""
        deployment = self._deployment(instance.role)
        if instance.where != deployment:
            raise ActuatorError(f"instance {instance.id} is in {instance.where}, not in deployment {deployment}")
        pods = self._pods(deployment)
        target = next((p for p in pods if p.metadata and p.metadata.name == instance.id), None)
        if target is None:
            raise ActuatorError(f"no pod {instance.id} in deployment {self.namespace}/{deployment}")
        if target.metadata and target.metadata.deletion_timestamp is not None:
            return
        earlier = [
            p.metadata.name or "?"
            for p in pods
            if p is not target and p.metadata and p.metadata.deletion_timestamp is None and _rank(p) < _rank(target)
        ]
        if earlier:
            raise ActuatorError(
                f"cannot stop pod {instance.id} yet: the ReplicaSet would remove {', '.join(earlier)} first "
                "(not scheduled, not running or not ready)"
            )
        with _api_call(f"set the deletion cost of pod {self.namespace}/{instance.id}"):
            self.core.patch_namespaced_pod(
                instance.id, self.namespace, {"metadata": {"annotations": {DELETION_COST: STOP_DELETION_COST}}}
            )
        n = self._replicas(deployment)
        self._scale(deployment, max(n - 1, 0))
        log.info(
            "autoscale: scaled deployment %s/%s to %d, removing pod %s", self.namespace, deployment, n - 1, instance.id
        )
