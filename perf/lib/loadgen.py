"""Load generation: arrival processes, the prompts and texts requests are made of, and an
open-loop replay over gRPC streaming.

- Arrivals: ``backend/planner/workload.py``'s ``poisson_arrivals`` (the planner's too).
- Datasets: ``make_prompt`` (distinct prompts of a given token length), ``HELDOUT`` (held-out
  English prose, ``perf/data/heldout_en.txt``), ``load_tokenizer``.
- ``replay``: send each request in a thread of its own at its arrival time, then wait for all
  (with a progress line: requests finished / planned); ``run`` replays a ``Workload`` of Poisson
  arrivals with fixed-length outputs (``ignore_eos``) against a server and records, per request,
  its submit time, the arrival time of every token, and token counts.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from backend.planner import stats, workload
from backend.planner.workload import poisson_arrivals
from perf.lib.machine import ROOT
from perf.lib.progress import Progress

HELDOUT = ROOT / "perf" / "data" / "heldout_en.txt"


def add_workload_args(p: argparse.ArgumentParser, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int]):
    """``--prompt-tokens MIN MAX`` and ``--output-tokens MIN MAX`` (uniform, inclusive) with
    these defaults, and ``--seed`` (default 0)."""
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=prompt_tokens)
    p.add_argument("--output-tokens", type=int, nargs=2, default=output_tokens)
    p.add_argument("--seed", type=int, default=0)


# --- datasets ---


def load_tokenizer(model: str | None = None):
    """The Hugging Face tokenizer of ``model`` (default: the prepared checkpoint)."""
    from transformers import AutoTokenizer

    from build_scripts.prepare_model import ensure_model

    return AutoTokenizer.from_pretrained(str(ensure_model(model)))


def make_prompt(tokenizer, n_tokens: int, rng: random.Random) -> str:
    """A distinct prompt of about ``n_tokens`` tokens (no prefix shared across requests)."""
    words = " ".join(
        f"{rng.choice(['item', 'case', 'note', 'part'])}{rng.randint(0, 99999)} is {rng.randint(0, 999)};"
        for _ in range(n_tokens // 4 + 8)
    )
    ids = tokenizer.encode(words, add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids)


# --- open-loop replay ---


def replay(
    offsets: Sequence[float],
    send: Callable[[int, float], object],
    *,
    drain_timeout_s: float,
    desc: str | None = "requests",
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """``backend/planner/workload.py``'s ``replay`` with a progress line (``desc``; None: none)
    counting the requests finished. Returns the start, by ``clock``."""
    with Progress(len(offsets), desc or "", unit="req", show=desc is not None) as progress:
        return workload.replay(offsets, send, drain_timeout_s=drain_timeout_s, on_done=progress.update, clock=clock)


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
    def gaps(self) -> list[float]:
        return stats.gaps(self.token_times)

    @property
    def decode_tokens_per_s(self) -> float:
        """Per-stream decode speed: tokens after the first over the time they took."""
        return stats.decode_rate(self.token_times)


def plan_requests(tokenizer, w: Workload) -> list[tuple[float, str, int, int]]:
    """(arrival offset, prompt, prompt tokens, max_tokens) for the whole run, from the seed."""
    rng = random.Random(w.seed)
    out: list[tuple[float, str, int, int]] = []
    for t in poisson_arrivals(w.rate, rng):
        if (len(out) >= w.n_requests) if w.n_requests > 0 else (t >= w.duration_s):
            break
        n_in = rng.randint(*w.prompt_tokens)
        prompt = make_prompt(tokenizer, n_in, rng)
        out.append((t, prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), rng.randint(*w.output_tokens)))
    return out


def run(
    url: str, tokenizer, w: Workload, model: str = "llm", desc: str | None = "requests"
) -> tuple[list[RequestRecord], float]:
    """Replay the planned requests against ``url``; returns records and the run's wall time.
    ``desc``: the progress line's label (None: no progress line)."""
    from backend.client import stream_generate

    plan = plan_requests(tokenizer, w)
    records = [RequestRecord(i, n_in, n_out, math.nan, offset) for i, (offset, _, n_in, n_out) in enumerate(plan)]

    def send(i: int, t_submit: float) -> None:
        # the scheduled submit time counts for TTFT, not the one stream_generate stamps
        rec = records[i]
        rec.t_submit = t_submit
        prompt = plan[i][1]
        res = stream_generate(url, prompt, rec.max_tokens, model=model, ignore_eos=True, timeout_s=w.drain_timeout_s)
        rec.token_times = list(res.times)
        rec.n_tokens = len(res.token_ids)
        rec.error = res.error

    t0 = replay([offset for offset, *_ in plan], send, drain_timeout_s=w.drain_timeout_s, desc=desc)
    return records, time.perf_counter() - t0


def warm_up(url: str, tokenizer, model: str = "llm") -> None:
    """Two short requests, so a measurement does not pay for first-call costs."""
    w = Workload(rate=1.0, n_requests=2, prompt_tokens=(64, 64), output_tokens=(4, 4), seed=99)
    run(url, tokenizer, w, model, desc=None)


def records_to_json(records: list[RequestRecord]) -> list[dict]:
    return [asdict(r) for r in records]
