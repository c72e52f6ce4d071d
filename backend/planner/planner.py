"""Candidate deployments, the goodput of each under an SLO as the simulator predicts it, and the
recommendation with its ``triton-disagg serve`` command line.

Candidates on one machine of ``cores`` cores: aggregated with every core, and disaggregated with
the cores split p:(cores - p) between one prefill and one decode instance, each for every
per-step token budget given. Candidates over ``nodes`` machines (nodes of ``node_threads``
threads each, no memory bus shared between roles): ``nodes`` aggregated instances, or p prefill
nodes feeding ``nodes - p`` decode nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from backend.engine.step_profile import EngineProfile
from backend.planner.simulator import Deployment, InstanceSpec, simulate
from backend.planner.slo import SLO, attainment, goodput, summary
from backend.planner.workload import TraceRequest


@dataclass(frozen=True)
class Candidate:
    deployment: Deployment
    serve_command: str


@dataclass
class Evaluation:
    candidate: Candidate
    goodput: float  # requests/s
    at_goodput: dict  # the simulated summary at that rate


def _sets(values: dict) -> str:
    return " ".join(f"--set {k}={v}" for k, v in values.items())


def machine_candidates(
    cores: int, budgets: list[int], threads_profiled: list[int], kv_tokens: int = 16384, max_num_seqs: int = 32
) -> list[Candidate]:
    out = []
    common = {"kv_cache_tokens": kv_tokens, "max_num_seqs": max_num_seqs}
    for b in budgets:
        if cores in threads_profiled:
            spec = InstanceSpec(cores, b, max_num_seqs, kv_tokens)
            sets = _sets({**common, "max_num_batched_tokens": b, "num_threads": cores})
            out.append(
                Candidate(
                    Deployment(f"aggregated {cores} threads, budget {b}", aggregated=(spec,)),
                    f"triton-disagg serve --mode aggregated {sets}",
                )
            )
        for p in range(1, cores):
            d = cores - p
            if p not in threads_profiled or d not in threads_profiled:
                continue
            pre, dec = InstanceSpec(p, b, max_num_seqs, kv_tokens), InstanceSpec(d, b, max_num_seqs, kv_tokens)
            cmd = (
                f"triton-disagg serve --mode disagg {_sets({**common, 'max_num_batched_tokens': b})} "
                f"--prefill-set num_threads={p} --prefill-set cpu_affinity={_cores(0, p)} "
                f"--decode-set num_threads={d} --decode-set cpu_affinity={_cores(p, d)}"
            )
            out.append(
                Candidate(Deployment(f"disagg {p}P:{d}D threads, budget {b}", prefill=(pre,), decode=(dec,)), cmd)
            )
    return out


def node_candidates(
    nodes: int, node_threads: int, budgets: list[int], kv_tokens: int = 16384, max_num_seqs: int = 32
) -> list[Candidate]:
    out = []
    common = {"kv_cache_tokens": kv_tokens, "max_num_seqs": max_num_seqs, "num_threads": node_threads}
    for b in budgets:
        sets = _sets({**common, "max_num_batched_tokens": b})
        agg = tuple(InstanceSpec(node_threads, b, max_num_seqs, kv_tokens, machine=i) for i in range(nodes))
        out.append(
            Candidate(
                Deployment(f"{nodes} aggregated nodes, budget {b}", aggregated=agg),
                f"on each of {nodes} nodes, behind a load balancer: triton-disagg serve --mode aggregated {sets}",
            )
        )
        for p in range(1, nodes):
            pre = tuple(InstanceSpec(node_threads, b, max_num_seqs, kv_tokens, machine=i) for i in range(p))
            dec = tuple(InstanceSpec(node_threads, b, max_num_seqs, kv_tokens, machine=p + i) for i in range(nodes - p))
            cmd = (
                f"on each of {p} prefill nodes: triton-disagg serve --mode prefill --discovery ETCD_URL "
                f"--messenger-host NODE_ADDRESS --deployment-secret-file SECRET {sets}; on each of {nodes - p} "
                f"decode nodes: triton-disagg serve --mode decode --discovery ETCD_URL "
                f"--deployment-secret-file SECRET {sets}"
            )
            out.append(
                Candidate(
                    Deployment(f"{p} prefill : {nodes - p} decode nodes, budget {b}", prefill=pre, decode=dec), cmd
                )
            )
    return out


def _cores(first: int, n: int) -> str:
    return ",".join(str(c) for c in range(first, first + n))


def evaluate(
    candidates: list[Candidate],
    profile: EngineProfile,
    slo: SLO,
    trace_at: Callable[[float], list[TraceRequest]],
    start_rate: float,
) -> list[Evaluation]:
    """Each candidate's simulated goodput, best first."""
    out = []
    for c in candidates:

        def attained(rate: float, dep=c.deployment) -> float:
            return attainment(simulate(dep, profile, trace_at(rate)), slo)

        g = goodput(attained, start_rate)
        at = summary(simulate(c.deployment, profile, trace_at(g))) if g > 0 else {}
        out.append(Evaluation(c, g, at))
    return sorted(out, key=lambda e: -e.goodput)


def table(evaluations: list[Evaluation]) -> str:
    lines = ["| deployment | goodput (req/s) | TTFT p50 at it (s) | ITL p90 at it (ms) |", "|---|---|---|---|"]
    for e in evaluations:
        a = e.at_goodput
        ttft = f"{a['ttft_p50']:.2f}" if a else "-"
        itl = f"{a['itl_p90'] * 1e3:.0f}" if a else "-"
        lines.append(f"| {e.candidate.deployment.name} | {e.goodput:.3f} | {ttft} | {itl} |")
    return "\n".join(lines)
