"""Open-loop load generator over gRPC streaming: Poisson arrivals, fixed-length outputs.

Each request gets a distinct prompt of a length drawn from ``prompt_tokens`` and asks for a
number of tokens drawn from ``output_tokens`` with ``ignore_eos`` so runs are comparable.
Arrivals stop after ``duration_s`` (or after ``n_requests``); in-flight requests are awaited (bounded by
``drain_timeout_s``). Per request it records submit time, time to first token, the arrival
time of every token, end-to-end latency and token counts.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import asdict, dataclass, field

from backend.client import stream_generate


@dataclass
class Workload:
    rate: float = 0.1  # requests per second (Poisson)
    duration_s: float = 120.0
    prompt_tokens: tuple[int, int] = (512, 1024)
    output_tokens: tuple[int, int] = (64, 128)
    seed: int = 0
    drain_timeout_s: float = 300.0
    n_requests: int = 0  # > 0: exactly this many arrivals (duration_s is then ignored)


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int
    max_tokens: int
    t_submit: float
    offset: float = 0.0  # planned arrival, seconds after the run's start
    token_times: list[float] = field(default_factory=list)
    n_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.t_submit if self.token_times else float("nan")

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.t_submit if self.token_times else float("nan")

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def decode_tokens_per_s(self) -> float:
        """Per-stream decode speed: tokens after the first over the time they took."""
        t = self.token_times
        return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else float("nan")


def make_prompt(tokenizer, n_tokens: int, rng: random.Random) -> str:
    """A distinct prompt of about ``n_tokens`` tokens (no prefix shared across requests)."""
    words = " ".join(
        f"{rng.choice(['item', 'case', 'note', 'part'])}{rng.randint(0, 99999)} is {rng.randint(0, 999)};"
        for _ in range(n_tokens // 4 + 8)
    )
    ids = tokenizer.encode(words, add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids)


def plan_requests(tokenizer, w: Workload) -> list[tuple[float, str, int, int]]:
    """(arrival offset, prompt, prompt tokens, max_tokens) for the whole run, from the seed."""
    rng = random.Random(w.seed)
    out, t = [], rng.expovariate(w.rate)
    while (len(out) < w.n_requests) if w.n_requests > 0 else (t < w.duration_s):
        n_in = rng.randint(*w.prompt_tokens)
        prompt = make_prompt(tokenizer, n_in, rng)
        out.append((t, prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), rng.randint(*w.output_tokens)))
        t += rng.expovariate(w.rate)
    return out


def run(url: str, tokenizer, w: Workload, model: str = "llm") -> tuple[list[RequestRecord], float]:
    """Replay the planned requests against ``url``; returns records and the run's wall time."""
    plan = plan_requests(tokenizer, w)
    records: list[RequestRecord] = []
    threads = []
    t0 = time.perf_counter()

    def one(rec: RequestRecord, prompt: str) -> None:
        res = stream_generate(url, prompt, rec.max_tokens, model=model, ignore_eos=True, timeout_s=w.drain_timeout_s)
        rec.token_times = list(res.times)
        rec.n_tokens = len(res.token_ids)
        rec.error = res.error
        # stream_generate stamps its own start; keep the scheduled submit time for TTFT

    for i, (offset, prompt, n_in, n_out) in enumerate(plan):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        rec = RequestRecord(i, n_in, n_out, time.perf_counter(), offset)
        records.append(rec)
        th = threading.Thread(target=one, args=(rec, prompt), daemon=True)
        th.start()
        threads.append(th)
    deadline = time.perf_counter() + w.drain_timeout_s
    for th in threads:
        th.join(max(0.0, deadline - time.perf_counter()))
    return records, time.perf_counter() - t0


def warm_up(url: str, tokenizer, model: str = "llm") -> None:
    """Two short requests, so a measurement does not pay for first-call costs."""
    run(url, tokenizer, Workload(rate=1.0, n_requests=2, prompt_tokens=(64, 64), output_tokens=(4, 4), seed=99), model)


def records_to_json(records: list[RequestRecord]) -> list[dict]:
    return [asdict(r) for r in records]
