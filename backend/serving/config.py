"""The configuration tree of a model instance, parsed once from its ``config.pbtxt`` string
parameters: ``role``, then one typed section per concern (engine, serving, KV connector,
membership). Defaults live in the section dataclasses and nowhere else; an unknown or malformed
parameter fails the model load with a message naming it (a renamed one is still accepted for a
release under its old name: ``backend/disagg/auth.py`` ``accept_renamed``). Tensor parallelism is the engine section's
``tensor_parallel_size``."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from backend.cluster.config import MembershipConfig
from backend.disagg.auth import accept_renamed
from backend.disagg.config import ConnectorConfig
from backend.engine.config import EngineConfig, field_types, parse_section, parse_value
from backend.engine.sampling_params import DRAFT_METHODS, MAX_DRAFT_TOKENS

ROLES = ("aggregated", "prefill", "decode")
# measured on the development machine (perf/history/REPORT-2026-12-02.md, "Conditional disaggregation")
LOCAL_PREFILL_MAX_TOKENS = 32
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class ServingConfig:
    """Admission and request defaults. ``max_queue_size``: requests active at once in the
    instance (more are refused as overloaded). ``speculative_k`` / ``draft_method``: what a
    request that sets neither gets. ``cpu_affinity``: cores to pin the instance's process to
    ("0", "0,1", "2-3"; empty: no pinning). Decode role: ``max_waiting_for_pages`` requests may
    wait up to ``page_wait_timeout_s`` for free KV pages, more are refused as overloaded.
    Guided decoding: a ``guided_json`` / ``guided_regex`` longer than ``max_grammar_bytes`` is
    refused; grammars compile on a worker thread, off the request path, and a request whose
    grammar takes longer than ``max_grammar_compile_s`` fails alone; compiled grammars are
    cached up to ``grammar_cache_bytes``. A prompt (``text_input``) longer than
    ``max_input_bytes`` is refused before it is decoded or tokenized. Decode role, conditional
    disaggregation: a request whose prompt part not in this instance's prefix cache is at most
    ``local_prefill_max_tokens`` tokens is prefilled here (chunked, between decode steps)
    instead of by a prefill instance; so is any request while every prefill instance has at
    least ``local_prefill_queue_bound`` requests outstanding (0: never by queue length). Decode
    role, ``kv_load_failure_policy``: when a remote prefill fails or its instance is lost during
    the transfer, ``recompute`` (once no late write can land in the request's pages) asks a
    prefill instance not tried yet for it, else computes the prompt here; ``fail`` ends the
    request with ``kv_transfer_failed``. ``drain_timeout_s``: a draining instance (``triton-disagg
    drain``, or its server stopping) takes no new requests and lets the ones in flight finish
    for this long; then it ends the rest as out of service, and routers move them elsewhere."""

    max_queue_size: int = 256
    speculative_k: int = 0
    draft_method: str = "lookup"
    cpu_affinity: str = ""
    max_waiting_for_pages: int = 32
    page_wait_timeout_s: float = 10.0
    max_grammar_bytes: int = 65536
    max_grammar_compile_s: float = 10.0
    grammar_cache_bytes: int = 64 << 20
    max_input_bytes: int = 1 << 20
    local_prefill_max_tokens: int = LOCAL_PREFILL_MAX_TOKENS
    local_prefill_queue_bound: int = 0
    kv_load_failure_policy: str = "recompute"
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {self.max_queue_size}")
        if not 0 <= self.speculative_k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"speculative_k must be in [0, {MAX_DRAFT_TOKENS}], got {self.speculative_k}")
        if self.draft_method not in DRAFT_METHODS:
            raise ValueError(f"draft_method must be one of {list(DRAFT_METHODS)}, got {self.draft_method!r}")
        if self.max_waiting_for_pages < 0:
            raise ValueError(f"max_waiting_for_pages must be >= 0, got {self.max_waiting_for_pages}")
        for name in ("page_wait_timeout_s", "max_grammar_compile_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("local_prefill_max_tokens", "local_prefill_queue_bound"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_grammar_bytes", "grammar_cache_bytes", "max_input_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {list(KV_LOAD_FAILURE_POLICIES)}, "
                f"got {self.kv_load_failure_policy!r}"
            )
        self.cores()

    def cores(self) -> set[int]:
        """``cpu_affinity`` as a set of core ids (empty: no pinning)."""
        cores: set[int] = set()
        for part in filter(None, (p.strip() for p in self.cpu_affinity.split(","))):
            lo, _, hi = part.partition("-")
            try:
                first, last = int(lo), int(hi or lo)
            except ValueError:
                raise ValueError(f"cpu_affinity {self.cpu_affinity!r}: {part!r} is not a core or a range") from None
            if first < 0 or last < first:
                raise ValueError(f"cpu_affinity {self.cpu_affinity!r}: bad range {part!r}")
            cores.update(range(first, last + 1))
        return cores

    def apply_cpu_affinity(self) -> None:
        if self.cpu_affinity.strip():
            os.sched_setaffinity(0, self.cores())


SECTIONS = {
    "engine": EngineConfig,
    "serving": ServingConfig,
    "connector": ConnectorConfig,
    "membership": MembershipConfig,
}


def _fields() -> dict[str, tuple[str, type]]:
    """parameter name -> (its section, its value type); names are unique across sections."""
    fields: dict[str, tuple[str, type]] = {}
    for section, cls in SECTIONS.items():
        for name, typ in field_types(cls).items():
            if name in fields:
                raise AssertionError(f"parameter {name!r} is in sections {fields[name][0]} and {section}")
            fields[name] = (section, typ)
    return fields


FIELDS = _fields()


def _by_section(params: dict) -> dict[str, dict]:
    """The parameters other than ``role``, grouped by section; an unknown one is refused by name."""
    params = accept_renamed(params)
    unknown = sorted(k for k in params if k != "role" and k not in FIELDS)
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown}; known: {sorted(['role', *FIELDS])}")
    grouped: dict[str, dict] = {s: {} for s in SECTIONS}
    for key, value in params.items():
        if key != "role":
            grouped[FIELDS[key][0]][key] = value
    return grouped


@dataclass(frozen=True)
class InstanceConfig:
    role: str
    engine: EngineConfig
    serving: ServingConfig
    connector: ConnectorConfig
    membership: MembershipConfig

    @classmethod
    def from_parameters(cls, params: dict) -> "InstanceConfig":
        """Parse a model's parameters (``{"role": "decode", "page_size": "16", ...}``)."""
        role = str(params.get("role") or "aggregated").strip()
        if role not in ROLES:
            raise ValueError(f"parameter 'role' must be one of {list(ROLES)}, got {role!r}")
        by_section = _by_section(params)
        if not str(by_section["engine"].get("model_path") or "").strip():
            raise ValueError(
                "parameter 'model_path' is empty: give the checkpoint directory "
                "(`triton-disagg serve` renders it; `triton-disagg prepare` makes the default one)"
            )
        return cls(
            role=role,
            engine=EngineConfig.from_dict(by_section["engine"]),
            serving=parse_section(ServingConfig, by_section["serving"], "serving"),
            connector=parse_section(ConnectorConfig, by_section["connector"], "connector"),
            membership=parse_section(MembershipConfig, by_section["membership"], "membership"),
        )


@dataclass(frozen=True)
class RouterSettings:
    """How a router treats its decode targets, the same for the Triton front model
    (:class:`FrontConfig`) and the OpenAI frontend (``backend/openai/``), defined here once.
    Each target's readiness (Triton's own ``ModelReady``) is probed every
    ``health_probe_interval_s``; a probe unanswered within ``health_probe_timeout_s`` or
    answered "not ready" counts as failed, and ``health_probe_failures`` failures in a row take
    the target out of routing (and move the requests in flight on it) until a probe succeeds
    again; whether it drains or cannot serve, and what it caches, its membership record says. Routing
    (``backend/serving/kv_router.py``): a request goes to the serving target with the lowest
    ``kv_routing_weight`` x (prompt pages not cached there) + (pages of the router's requests in
    flight there); 0: least loaded. ``migration_limit``: how many times one request may move to
    another target when its own goes down, fails it as out of service or stops in the middle of
    its stream (request migration: the prompt plus the tokens already sent go to another target,
    which continues the stream); past it the request fails with an error that says so; 0: never
    moved."""

    health_probe_interval_s: float = 1.0
    health_probe_timeout_s: float = 5.0
    health_probe_failures: int = 2
    kv_routing_weight: float = 1.0
    migration_limit: int = 3

    def __post_init__(self) -> None:
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        for name in ("health_probe_interval_s", "health_probe_timeout_s", "health_probe_failures"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kv_routing_weight < 0:
            raise ValueError(f"kv_routing_weight must be >= 0, got {self.kv_routing_weight}")

    @classmethod
    def from_parameters(cls, params: dict) -> "RouterSettings":
        return parse_section(cls, params, "router")


# the settings' names: Triton model parameters of the front model, and the OpenAI frontend's
# flags (``--migration-limit`` ...)
ROUTER_SETTINGS = tuple(f.name for f in dataclasses.fields(RouterSettings))


@dataclass(frozen=True)
class FrontConfig(RouterSettings):
    """The disaggregated front model, with the router settings of :class:`RouterSettings`.
    ``decode_models``: the decode models of its own server it routes to (comma-separated); empty:
    every decode instance in the deployment's membership (``membership.discovery``), on every
    server of the deployment (over gRPC, its own server's too; by BLS only where the server's
    address is unknown). Either way it reads what the decode instances' records say where
    ``discovery`` is set.
    ``model_path``: the tokenizer that makes the prompt's token ids for KV-aware routing (the
    decode models' own); empty: routed by load alone. ``membership``: the membership parameters
    (``discovery``, ``deployment``, ``deployment_secret_file``, ...: :class:`MembershipConfig`)."""

    decode_models: str = ""
    model_path: str = ""
    membership: MembershipConfig = dataclasses.field(default_factory=MembershipConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.targets() and not self.membership.discovery:
            raise ValueError(
                "parameter 'decode_models' lists no decode model and no 'discovery' names the deployment's "
                "membership: the front model has nothing to route to"
            )

    def targets(self) -> list[str]:
        """The fixed decode models (empty: the membership's decode instances)."""
        return [m.strip() for m in self.decode_models.split(",") if m.strip()]

    @classmethod
    def from_parameters(cls, params: dict) -> "FrontConfig":
        params = accept_renamed(dict(params))
        section = {k: v for k, v in params.items() if k in MEMBERSHIP_FIELDS}
        rest = {k: v for k, v in params.items() if k not in MEMBERSHIP_FIELDS}
        if "membership" in rest:
            raise ValueError("parameter 'membership' names a section of settings, not a value")
        membership = parse_section(MembershipConfig, section, "membership")
        return parse_section(cls, {**rest, "membership": membership}, "front model")


MEMBERSHIP_FIELDS = frozenset(field_types(MembershipConfig))


def parameter_defaults(role: str) -> dict[str, str]:
    """Every parameter of a role's model with its default, as config.pbtxt strings."""
    if role == "front":
        fields = [f for f in dataclasses.fields(FrontConfig) if f.name != "membership"]
        return {f.name: _to_string(f.default) for f in [*fields, *dataclasses.fields(MembershipConfig)]}
    out = {"role": role, "model_path": ""}
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            if f.init and f.name != "model_path":
                out[f.name] = _to_string(f.default)
    return out


def check_parameters(role: str, params: dict) -> None:
    """Refuse unknown keys and malformed values without building anything (for rendering)."""
    if role == "front":
        FrontConfig.from_parameters(params)
        return
    for values in _by_section(params).values():
        for key, value in values.items():
            if str(value).strip():
                parse_value(key, value, FIELDS[key][1])


def _to_string(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
