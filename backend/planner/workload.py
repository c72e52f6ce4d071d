"""The requests a plan is made for: a Poisson stream with uniform prompt and output lengths,
or a trace file (JSON lines ``{"arrival_s": ..., "prompt_tokens": ..., "output_tokens": ...}``,
the format ``perf.goodput`` writes for every measured point)."""

from __future__ import annotations

import json
import random
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


def poisson(
    rate: float, n: int, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int], seed: int = 0
) -> list[TraceRequest]:
    """``n`` Poisson arrivals at ``rate`` requests/s; lengths uniform over the inclusive ranges."""
    if rate <= 0 or n < 1:
        raise ValueError(f"poisson workload needs rate > 0 and n >= 1, got rate={rate}, n={n}")
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(TraceRequest(t, rng.randint(*prompt_tokens), rng.randint(*output_tokens)))
    return out


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
