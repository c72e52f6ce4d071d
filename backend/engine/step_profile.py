"""The engine profile: how long one scheduler step takes, as a function of what it runs, per
torch thread count; stored as JSON and re-used by every plan (``backend/planner/``) and by the
emulated engine, which waits this long instead of computing (``emulated_runner.py``).

A step runs chunks, each ``(new tokens, tokens already in the KV cache)``. Its time is modelled
as ``a + b * sequences + c * new tokens + d * prefill attention + e * batched + f * decode
attention`` where the attention terms count the query-key pairs of the step in thousands
(``new * (context + (new + 1) / 2) / 1000`` per chunk), of chunks of several tokens and of single
decode tokens apart: on a GPU a decode token's attention reads the whole KV context from memory
(~17 us per 1000 pairs for an 8B model on an H100) while a prefill chunk's is compute bound (~1 us).
Batched is 1 when the step runs more than one token: the linear layers then use matrix-matrix
kernels, which on this CPU cost about twice the matrix-vector ones of a single decode token
(measured: a batch of 2 decode tokens takes ~1.5x the step time of 1).
The coefficients are fitted, non-negative and by relative error, to measured steps: decode
batches of several sizes and contexts, prefill chunks of several sizes, and mixes. The samples
are kept in the file, so a profile can be refitted or checked; how much the measured steps
scatter around the model (``spread``, the standard deviation of the relative residuals) is
what the simulator draws each step's variation from.

Measured next to the steps:
- ``corun_slowdown``: the factor a step's time grows by while another instance computes on the
  other cores of the same machine (they share the memory bus); 1.0 when unmeasured.
- ``handoff_s``: disaggregated only, the time from a prefill's last chunk to the decode instance
  having the request ready (KV transfer tail and the messenger's notices).
- ``served_overhead_s``: per thread count, what a served instance's step takes beyond the
  engine's own (the response path, and Triton's threads competing with torch's for the cores):
  ``[single-token step, batched step]``; empty for the bare engine.
- ``request_overhead_s``: time from a request's arrival at the server to its arrival at the
  engine (the front, the client path); 0 for the bare engine.
The last three are calibrated from single requests through a real server
(``perf.served_profile``); a bare engine profile leaves them at their defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

PROFILES = Path(__file__).resolve().parent / "profiles"  # the profiles shipped with the engine
PROFILE_VERSION = 3
FEATURES = ("step", "sequence", "token", "prefill_attention_kpairs", "batched", "decode_attention_kpairs")
# a version 2 file (one attention term) still loads: its samples are kept, and refitted with these
_V2_FEATURES = ["step", "sequence", "token", "attention_kpairs", "batched"]

Chunk = tuple[int, int]  # (new tokens, context tokens before them)


def features(chunks: list[Chunk]) -> list[float]:
    new = sum(n for n, _ in chunks)
    prefill = sum(n * (ctx + (n + 1) / 2) for n, ctx in chunks if n > 1) / 1000.0
    decode = sum(ctx + 1 for n, ctx in chunks if n == 1) / 1000.0
    return [1.0, float(len(chunks)), float(new), prefill, 1.0 if new > 1 else 0.0, decode]


@dataclass
class StepSample:
    chunks: list[Chunk]
    seconds: float


@dataclass
class StepCost:
    """Fitted step-time coefficients (seconds per feature, see :data:`FEATURES`)."""

    coef: list[float]

    def step_time(self, chunks: list[Chunk]) -> float:
        return sum(c * f for c, f in zip(self.coef, features(chunks)))

    @classmethod
    def fit(cls, samples: list[StepSample]) -> "StepCost":
        """Least squares on relative error with every coefficient >= 0 (a negative one is
        dropped and the rest refitted)."""
        import numpy as np

        if not samples:
            raise ValueError("cannot fit a step cost to no samples")
        x = np.array([features(s.chunks) for s in samples])
        y = np.array([s.seconds for s in samples])
        w = 1.0 / y
        active = list(range(len(FEATURES)))
        while True:
            sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
            if (sol >= 0).all() or len(active) == 1:
                coef = [0.0] * len(FEATURES)
                for i, v in zip(active, sol):
                    coef[i] = max(0.0, float(v))
                return cls(coef)
            active.pop(int(np.argmin(sol)))

    def relative_errors(self, samples: list[StepSample]) -> list[float]:
        return [abs(self.step_time(s.chunks) - s.seconds) / s.seconds for s in samples]


@dataclass
class ThreadProfile:
    """One thread count's measured steps and the model fitted to them."""

    threads: int
    samples: list[StepSample]
    cost: StepCost = field(init=False)
    spread: float = field(init=False)  # std of the relative residuals: how much steps vary

    def __post_init__(self) -> None:
        self.cost = StepCost.fit(self.samples)
        errs = [(s.seconds - self.cost.step_time(s.chunks)) / s.seconds for s in self.samples]
        mean = sum(errs) / len(errs)
        self.spread = (sum((e - mean) ** 2 for e in errs) / len(errs)) ** 0.5


@dataclass
class EngineProfile:
    model: str
    weights_dtype: str
    page_size: int
    threads: dict[int, ThreadProfile]
    corun_slowdown: float = 1.0
    handoff_s: float = 0.0
    served_overhead_s: dict[int, list[float]] = field(default_factory=dict)
    request_overhead_s: float = 0.0
    version: int = PROFILE_VERSION
    source: str = ""  # where the samples come from: the machine measured, or the published figures

    def cost(self, threads: int) -> StepCost:
        if threads not in self.threads:
            raise KeyError(f"the profile has no {threads}-thread measurements (it has {sorted(self.threads)})")
        return self.threads[threads].cost

    def step_time(self, threads: int, chunks: list[Chunk]) -> float:
        return self.cost(threads).step_time(chunks) + self.overhead(threads, chunks)

    def overhead(self, threads: int, chunks: list[Chunk]) -> float:
        """The served-instance overhead of a step (0 where uncalibrated)."""
        oh = self.served_overhead_s.get(threads)
        if not oh:
            return 0.0
        return oh[1] if sum(n for n, _ in chunks) > 1 else oh[0]

    def scaled(self, speedup: float) -> "EngineProfile":
        """This profile on hardware ``speedup`` times as fast: every measured step divided by it."""
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        threads = {
            t: ThreadProfile(t, [StepSample(s.chunks, s.seconds / speedup) for s in p.samples])
            for t, p in self.threads.items()
        }
        return EngineProfile(
            self.model,
            self.weights_dtype,
            self.page_size,
            threads,
            self.corun_slowdown,
            self.handoff_s,
            {t: [v / speedup for v in oh] for t, oh in self.served_overhead_s.items()},
            self.request_overhead_s,
            source=f"{self.source} (every step / {speedup:g})",
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "model": self.model,
                "source": self.source,
                "weights_dtype": self.weights_dtype,
                "page_size": self.page_size,
                "corun_slowdown": self.corun_slowdown,
                "handoff_s": self.handoff_s,
                "served_overhead_s": {str(t): list(v) for t, v in sorted(self.served_overhead_s.items())},
                "request_overhead_s": self.request_overhead_s,
                "features": list(FEATURES),
                "threads": {
                    str(t): {
                        "coef": p.cost.coef,
                        "samples": [{"chunks": [list(c) for c in s.chunks], "seconds": s.seconds} for s in p.samples],
                    }
                    for t, p in sorted(self.threads.items())
                },
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> "EngineProfile":
        obj = json.loads(text)
        if obj.get("version") not in (2, PROFILE_VERSION):
            raise ValueError(f"profile version {obj.get('version')!r} is not {PROFILE_VERSION}: profile again")
        known = {f for f in cls.__dataclass_fields__} | {"features"}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ValueError(f"unknown profile fields: {unknown}")
        if obj.get("features") != (list(FEATURES) if obj["version"] == PROFILE_VERSION else _V2_FEATURES):
            raise ValueError(f"profile features {obj.get('features')} are not {list(FEATURES)}: profile again")
        threads = {
            int(t): ThreadProfile(
                int(t),
                [StepSample([(int(n), int(c)) for n, c in s["chunks"]], float(s["seconds"])) for s in p["samples"]],
            )
            for t, p in obj["threads"].items()
        }
        return cls(
            model=obj["model"],
            weights_dtype=obj["weights_dtype"],
            page_size=int(obj["page_size"]),
            threads=threads,
            corun_slowdown=float(obj.get("corun_slowdown", 1.0)),
            handoff_s=float(obj.get("handoff_s", 0.0)),
            served_overhead_s={int(t): [float(x) for x in v] for t, v in obj.get("served_overhead_s", {}).items()},
            request_overhead_s=float(obj.get("request_overhead_s", 0.0)),
            source=str(obj.get("source", "")),
        )

    def save(self, path: Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: Path) -> "EngineProfile":
        return cls.from_json(Path(path).read_text())

    def summary(self) -> dict:
        return {
            t: {
                "coef_ms": [round(c * 1e3, 4) for c in p.cost.coef],
                "fit_error_mean": _mean(p.cost.relative_errors(p.samples)),
            }
            for t, p in sorted(self.threads.items())
        } | {
            "corun_slowdown": self.corun_slowdown,
            "handoff_s": self.handoff_s,
            "served_overhead_s": self.served_overhead_s,
        }


def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else float("nan")


def profile_path(name: str) -> Path:
    """A profile's file: ``name`` is one shipped in :data:`PROFILES` (without ``.json``) or a path."""
    shipped = PROFILES / f"{name}.json"
    if "/" not in name and shipped.is_file():
        return shipped
    path = Path(name)
    if path.is_file():
        return path
    names = sorted(p.stem for p in PROFILES.glob("*.json"))
    raise ValueError(f"engine profile {name!r}: no such file, and not one of the shipped profiles {names}")
