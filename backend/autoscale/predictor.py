"""The next interval's load from the ones measured: Holt's linear exponential smoothing of the
arrival rate (a level and a trend, so a ramp is followed rather than trailed), and plain
exponential smoothing of the mean prompt and output lengths. Every prediction is kept beside what
was measured next, so the autoscaler can say how far off it was."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    arrivals_per_s: float
    prompt_tokens: float
    output_tokens: float


class LoadPredictor:
    """``update(observed)`` once an interval; ``predict()`` the next interval's load.

    ``alpha`` weighs the newest rate against the level, ``beta`` the newest change against the
    trend; lengths keep their last value when an interval had no request."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3, prompt_tokens: float = 256, output_tokens: float = 64):
        if not (0 < alpha <= 1 and 0 <= beta <= 1):
            raise ValueError(f"alpha must be in (0, 1] and beta in [0, 1], got {alpha}, {beta}")
        self.alpha, self.beta = alpha, beta
        self._level: float | None = None
        self._trend = 0.0
        self._prompt = prompt_tokens
        self._output = output_tokens

    def update(self, observed: Load) -> None:
        rate = max(0.0, observed.arrivals_per_s)
        if self._level is None:
            self._level = rate
        else:
            level = self.alpha * rate + (1 - self.alpha) * (self._level + self._trend)
            self._trend = self.beta * (level - self._level) + (1 - self.beta) * self._trend
            self._level = level
        if not math.isnan(observed.prompt_tokens):
            self._prompt = self.alpha * observed.prompt_tokens + (1 - self.alpha) * self._prompt
        if not math.isnan(observed.output_tokens):
            self._output = self.alpha * observed.output_tokens + (1 - self.alpha) * self._output

    def predict(self) -> Load:
        rate = max(0.0, (self._level or 0.0) + self._trend)
        return Load(rate, self._prompt, self._output)
