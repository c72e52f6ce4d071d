"""The requests a plan is made for, and the load the benchmarks replay: a Poisson stream with
uniform prompt and output lengths, or a trace file (JSON lines ``{"arrival_s": ...,
"prompt_tokens": ..., "output_tokens": ...}``, the format ``perf.goodput`` writes for every
measured point).

The arrival processes, defined once: each a generator of arrival offsets in seconds drawing from
the caller's ``random.Random``, so that lengths drawn between arrivals come from the same seeded
stream: ``poisson_arrivals`` at a fixed rate; ``phased_arrivals``, Poisson at a rate that changes
by ``Phase`` (``ramp_trace``: a whole trace of them with uniformly drawn lengths). ``replay``
sends requests open-loop at their arrival offsets, each in a thread of its own."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

TRACE_FIELDS = ("arrival_s", "prompt_tokens", "output_tokens")


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if self.arrival_s < 0 or self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"bad trace request {self}: arrival_s >= 0, prompt_tokens and output_tokens >= 1")


def poisson_arrivals(rate: float, rng: random.Random, start: float = 0.0) -> Iterator[float]:
    """Poisson arrivals at ``rate`` per second after ``start``, without end."""
    t = start
    while True:
        t += rng.expovariate(rate)
        yield t


@dataclass(frozen=True)
class Phase:
    duration_s: float
    rate: float  # requests per second


def parse_phases(text: str) -> list[Phase]:
    """``seconds:rate,seconds:rate,...`` -> phases."""
    out = []
    for item in text.split(","):
        d, _, r = item.partition(":")
        out.append(Phase(float(d), float(r)))
    return out


def phased_arrivals(phases: Sequence[Phase], rng: random.Random) -> Iterator[float]:
    """Poisson arrivals at each phase's rate (none in a phase of rate 0), phase after phase."""
    start = 0.0
    for ph in phases:
        if ph.rate > 0:
            for t in poisson_arrivals(ph.rate, rng, start):
                if t >= start + ph.duration_s:
                    break
                yield t
        start += ph.duration_s


def _with_lengths(
    arrivals: Iterator[float], rng: random.Random, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int]
) -> Iterator[TraceRequest]:
    """Each arrival with a prompt and an output length drawn uniformly (after its arrival)."""
    for t in arrivals:
        yield TraceRequest(t, rng.randint(*prompt_tokens), rng.randint(*output_tokens))


def poisson(
    rate: float, n: int, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int], seed: int = 0
) -> list[TraceRequest]:
    """``n`` Poisson arrivals at ``rate`` requests/s; lengths uniform over the inclusive ranges."""
    if rate <= 0 or n < 1:
        raise ValueError(f"poisson workload needs rate > 0 and n >= 1, got rate={rate}, n={n}")
    rng = random.Random(seed)
    requests = _with_lengths(poisson_arrivals(rate, rng), rng, prompt_tokens, output_tokens)
    return [next(requests) for _ in range(n)]


def ramp_trace(
    phases: Sequence[Phase], prompt_tokens: tuple[int, int], output_tokens: tuple[int, int], seed: int = 0
) -> list[TraceRequest]:
    """Phased Poisson arrivals, each with a prompt and an output length drawn uniformly."""
    rng = random.Random(seed)
    return list(_with_lengths(phased_arrivals(phases, rng), rng, prompt_tokens, output_tokens))


def scaled(trace: list[TraceRequest], rate: float) -> list[TraceRequest]:
    """The trace replayed at ``rate`` requests/s on average: arrival times stretched or squeezed."""
    if len(trace) < 2 or trace[-1].arrival_s <= 0:
        return list(trace)
    own = len(trace) / trace[-1].arrival_s
    return [TraceRequest(r.arrival_s * own / rate, r.prompt_tokens, r.output_tokens) for r in trace]


def save_trace(path: Path, trace: list[TraceRequest]) -> None:
    Path(path).write_text("".join(json.dumps(asdict(r)) + "\n" for r in trace))


def load_trace(path: Path) -> list[TraceRequest]:
    """Requests sorted by arrival; a line with a missing or unknown field is an error naming it."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        unknown = sorted(set(obj) - set(TRACE_FIELDS))
        missing = [f for f in TRACE_FIELDS if f not in obj]
        if unknown or missing:
            raise ValueError(f"{path}:{n}: unknown fields {unknown}, missing fields {missing}")
        out.append(TraceRequest(float(obj["arrival_s"]), int(obj["prompt_tokens"]), int(obj["output_tokens"])))
    if not out:
        raise ValueError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.arrival_s)


def replay(
    offsets: Sequence[float],
    send: Callable[[int, float], object],
    *,
    drain_timeout_s: float,
    on_done: Callable[[], object] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Call ``send(i, t_submit)`` in a thread of its own ``offsets[i]`` seconds after the start
    (``t_submit``: ``clock()`` as it is sent), then wait for every request, up to
    ``drain_timeout_s`` after the last arrival; ``on_done()`` as each returns. Returns the start,
    by ``clock``."""
    threads = []
    t0 = clock()

    def one(i: int, t_submit: float) -> None:
        try:
            send(i, t_submit)
        finally:
            if on_done is not None:
                on_done()

    for i, offset in enumerate(offsets):
        delay = t0 + offset - clock()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(i, clock()), daemon=True)
        th.start()
        threads.append(th)
    deadline = clock() + drain_timeout_s
    for th in threads:
        th.join(max(0.0, deadline - clock()))
    return t0
