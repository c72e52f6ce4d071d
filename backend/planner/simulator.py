"""A discrete-event model of a deployment serving a trace: each engine instance runs the
scheduler's policy step by step, and a step lasts what the profile says.

The policy mirrored (``backend/engine/scheduler.py``): each step takes, within the token
budget, one token of every decoding sequence, then the next chunk of sequences part way through
their prompt, then waiting sequences in FIFO order while fewer than ``max_num_seqs`` run and the
pool can commit their pages (prompt + output tokens); nothing is preempted. A token is emitted at
the end of the step that computed the position before it.

Deployments:
- aggregated: requests go to the ``llm`` instance with the fewest outstanding requests.
- disaggregated: a request goes to the decode instance with the fewest outstanding requests,
  which reserves its pages first (or queues until it can), and then to the prefill instance with
  the fewest; the prefill computes all prompt tokens but the last, frees its pages, and after
  ``handoff_s`` the decode instance has the request ready: its first step computes the last
  prompt token and emits the first output token. A prompt of at most
  ``local_prefill_max_tokens`` tokens is prefilled on the decode instance.
A request reaches its first instance ``request_overhead_s`` after it arrives; every step lasts
the engine's time plus the served overhead of its thread count (the profile's served terms).
Each step's time is drawn around the model with the profile's measured ``spread`` (lognormal,
seeded; none for a profile that fits its samples exactly). Instances on the same ``machine``
share its memory bus: a step that starts while another of
them is computing lasts ``corun_slowdown`` times longer.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from backend.engine.step_profile import EngineProfile
from backend.planner.workload import TraceRequest


@dataclass(frozen=True)
class InstanceSpec:
    threads: int = 1
    budget: int = 256
    max_num_seqs: int = 32
    kv_tokens: int = 16384
    machine: int = 0


@dataclass(frozen=True)
class Deployment:
    name: str
    aggregated: tuple[InstanceSpec, ...] = ()
    prefill: tuple[InstanceSpec, ...] = ()
    decode: tuple[InstanceSpec, ...] = ()
    local_prefill_max_tokens: int = 32

    def __post_init__(self) -> None:
        if bool(self.aggregated) == bool(self.prefill or self.decode):
            raise ValueError(f"{self.name}: a deployment is aggregated instances or prefill + decode instances")
        if not self.aggregated and not (self.prefill and self.decode):
            raise ValueError(f"{self.name}: a disaggregated deployment needs prefill and decode instances")

    @property
    def disaggregated(self) -> bool:
        return not self.aggregated


@dataclass
class RequestResult:
    request: TraceRequest
    token_times: list[float] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return len(self.token_times) == self.request.output_tokens

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.request.arrival_s if self.token_times else math.inf

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


class _Seq:
    """One request's share of one instance: ``total`` tokens to hold, ``computed`` of them done."""

    __slots__ = ("result", "total", "computed", "emits", "pages", "reserved")

    def __init__(self, result: RequestResult, total: int, computed: int, emits: bool, pages: int, reserved: bool):
        self.result, self.total, self.computed, self.emits = result, total, computed, emits
        self.pages, self.reserved = pages, reserved


class _Instance:
    def __init__(self, spec: InstanceSpec, sim: "_Simulation"):
        self.spec, self.sim = spec, sim
        self.free_pages = math.ceil(spec.kv_tokens / sim.page_size)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.pending: deque[RequestResult] = deque()  # decode: requests waiting for pages to reserve
        self.busy_until = -1.0
        self.outstanding = 0

    def schedule(self) -> list[tuple[_Seq, int]]:
        budget = self.spec.budget
        chunks: list[tuple[_Seq, int]] = []
        decoding = [s for s in self.running if s.total - s.computed == 1]
        prefilling = [s for s in self.running if s.total - s.computed > 1]
        for s in decoding + prefilling:
            if budget == 0:
                return chunks
            n = min(s.total - s.computed, budget)
            chunks.append((s, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.spec.max_num_seqs:
            s = self.waiting[0]
            if not s.reserved:
                if s.pages > self.free_pages:
                    break
                self.free_pages -= s.pages
            self.waiting.popleft()
            self.running.append(s)
            n = min(s.total - s.computed, budget)
            chunks.append((s, n))
            budget -= n
        return chunks


class _Simulation:
    def __init__(self, deployment: Deployment, profile: EngineProfile, seed: int = 0):
        self.d, self.profile, self.page_size = deployment, profile, profile.page_size
        self.rng = random.Random(seed)
        self.events: list = []
        self.order = 0
        self.now = 0.0
        self.agg = [_Instance(s, self) for s in deployment.aggregated]
        self.prefill = [_Instance(s, self) for s in deployment.prefill]
        self.decode = [_Instance(s, self) for s in deployment.decode]
        self.instances = self.agg + self.prefill + self.decode
        self.owners: dict[int, tuple[_Instance, int]] = {}  # prefill seq -> (its decode instance, pages reserved)

    def at(self, t: float, fn, *args) -> None:
        self.order += 1
        heapq.heappush(self.events, (t, self.order, fn, args))

    def pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    @staticmethod
    def least_loaded(instances: list[_Instance]) -> _Instance:
        return min(instances, key=lambda i: i.outstanding)

    def run(self, trace: list[TraceRequest]) -> list[RequestResult]:
        results = [RequestResult(r) for r in trace]
        for res in results:
            self.at(res.request.arrival_s + self.profile.request_overhead_s, self.arrive, res)
        while self.events:
            t, _, fn, args = heapq.heappop(self.events)
            self.now = t
            fn(*args)
        return results

    def arrive(self, res: RequestResult) -> None:
        r = res.request
        if not self.d.disaggregated:
            inst = self.least_loaded(self.agg)
            inst.outstanding += 1
            inst.waiting.append(
                _Seq(res, r.prompt_tokens, 0, True, self.pages(r.prompt_tokens + r.output_tokens), False)
            )
            self.kick(inst)
            return
        inst = self.least_loaded(self.decode)
        inst.outstanding += 1
        if r.prompt_tokens <= max(1, self.d.local_prefill_max_tokens):
            inst.waiting.append(
                _Seq(res, r.prompt_tokens, 0, True, self.pages(r.prompt_tokens + r.output_tokens), False)
            )
            self.kick(inst)
            return
        inst.pending.append(res)
        self.reserve(inst)

    def reserve(self, dec: _Instance) -> None:
        """Decode side first: reserve the pages, then ask a prefill instance for the KV."""
        while dec.pending:
            r = dec.pending[0].request
            need = self.pages(r.prompt_tokens + r.output_tokens)
            if need > dec.free_pages:
                return
            res = dec.pending.popleft()
            dec.free_pages -= need
            pre = self.least_loaded(self.prefill)
            pre.outstanding += 1
            n = r.prompt_tokens - 1
            seq = _Seq(res, n, 0, False, self.pages(n), False)
            pre.waiting.append(seq)
            self.owners[id(seq)] = (dec, need)
            self.kick(pre)

    def kick(self, inst: _Instance) -> None:
        if inst.busy_until > self.now:
            return
        chunks = inst.schedule()
        if not chunks:
            return
        t = self.profile.step_time(inst.spec.threads, [(n, s.computed) for s, n in chunks])
        sigma = self.profile.threads[inst.spec.threads].spread
        if sigma > 0:
            t *= math.exp(self.rng.gauss(-sigma * sigma / 2, sigma))
        if any(
            o is not inst and o.spec.machine == inst.spec.machine and o.busy_until > self.now for o in self.instances
        ):
            t *= self.profile.corun_slowdown
        inst.busy_until = self.now + t
        self.at(inst.busy_until, self.step_done, inst, chunks)

    def step_done(self, inst: _Instance, chunks: list[tuple[_Seq, int]]) -> None:
        for s, n in chunks:
            s.computed += n
            if s.computed < s.total:
                continue
            if not s.emits:  # a prefill instance's part is done: free its pages, hand over
                self.finish(inst, s)
                dec, need = self.owners.pop(id(s))
                res = s.result
                self.at(self.now + self.profile.handoff_s, self.handed_over, dec, res, need)
                continue
            s.result.token_times.append(self.now)
            if len(s.result.token_times) >= s.result.request.output_tokens:
                self.finish(inst, s)
            else:
                s.total += 1
        self.kick(inst)

    def handed_over(self, dec: _Instance, res: RequestResult, pages: int) -> None:
        r = res.request
        dec.waiting.append(_Seq(res, r.prompt_tokens, r.prompt_tokens - 1, True, pages, True))
        self.kick(dec)

    def finish(self, inst: _Instance, s: _Seq) -> None:
        inst.running.remove(s)
        inst.free_pages += s.pages
        inst.outstanding -= 1
        if inst.pending:
            self.reserve(inst)


def simulate(
    deployment: Deployment, profile: EngineProfile, trace: list[TraceRequest], seed: int = 0
) -> list[RequestResult]:
    """Every request's token times when ``deployment`` serves ``trace``. A request whose pages
    can never fit stays with no tokens (it counts as failing any SLO)."""
    return _Simulation(deployment, profile, seed).run(sorted(trace, key=lambda r: r.arrival_s))
