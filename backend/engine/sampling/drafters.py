"""Drafters for speculative decoding: each proposes up to ``k`` next tokens for one sequence.

- ``lookup`` (:class:`PromptLookupDrafter`, the default): n-gram prompt lookup. The last ``n``
  tokens (n = 3, 2, 1) are searched for, most recent occurrence first, in the prompt + output so
  far; the tokens that followed that occurrence are the proposal. No extra weights.
- ``hidden`` (:class:`HiddenStateDrafter`): fed by the hidden state of the sequence's last
  computed position, as an MTP/EAGLE head is. The checkpoint ships no draft head, so the stand-in
  "head" is the target's own final norm + lm_head, i.e. the logits that travel with that hidden
  state (transferred from the prefill instance with the KV, or computed locally by the last
  prefill chunk / decode step): its argmax is the first draft token, prompt lookup continues from
  there. It proves the data path, not a good acceptance rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from backend.engine.sequence import Sequence

MAX_NGRAM = 3


class Drafter(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]: ...


def lookup_continuation(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram (n <= max_ngram) of ``tokens``; [] when no suffix n-gram occurs earlier."""
    if k <= 0 or len(tokens) < 2:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        windows = sliding_window_view(arr[:-1], n)  # windows starting at j end before the last token
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return []


class PromptLookupDrafter:
    def propose(self, seq: Sequence, k: int) -> list[int]:
        return lookup_continuation(seq.token_ids, k)


class HiddenStateDrafter:
    def propose(self, seq: Sequence, k: int) -> list[int]:
        if k <= 0:
            return []
        if seq.last_logits is None:
            return lookup_continuation(seq.token_ids, k)
        first = int(seq.last_logits.argmax())
        return [first] + lookup_continuation(seq.token_ids + [first], k - 1)


DRAFTERS: dict[str, Callable[[], Drafter]] = {"lookup": PromptLookupDrafter, "hidden": HiddenStateDrafter}


def make_drafters() -> dict[str, Drafter]:
    return {name: cls() for name, cls in DRAFTERS.items()}
