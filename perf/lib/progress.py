"""A one-line progress display for long benchmark runs (``tqdm``, on stderr).

Shown only when stderr is a terminal, so logs and captured output stay clean;
``TRITON_DISAGG_PROGRESS=1`` shows it anyway (into a log, say) and ``TRITON_DISAGG_PROGRESS=0``
never. The bar is erased when its step ends: what a benchmark prints is unchanged.

    for rep in bar(range(reps), "prefill"):
        ...
    with Progress(len(plan), "requests") as p:   # updated from any thread
        p.update()
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

ENV = "TRITON_DISAGG_PROGRESS"
T = TypeVar("T")


def enabled() -> bool:
    """Whether progress is shown: ``$TRITON_DISAGG_PROGRESS`` (1 or 0) if set, else whether stderr
    is a terminal."""
    setting = os.environ.get(ENV, "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """``done / total`` with a label, one line on stderr; every method is a no-op when progress
    is off. Thread-safe."""

    def __init__(self, total: int | None, desc: str, unit: str = "it", show: bool = True):
        self._lock = threading.Lock()
        self._bar = None
        if show and enabled():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True, mininterval=0.5
            )

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def note(self, text: str) -> None:
        """A short status after the count (e.g. the figure just measured)."""
        if self._bar is not None:
            with self._lock:
                self._bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.close()
                self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bar(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """``items``, counted on a progress line as each one is done."""
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with Progress(total, desc, unit) as p:
        for item in items:
            yield item
            p.update()
