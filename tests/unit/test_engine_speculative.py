"""Speculative decoding in the engine: drafters, the verification rule, and greedy outputs that
are token-for-token those of plain decoding (aggregated and decode role, batched, with stop
conditions), with rejected drafts rolled back (num_computed and pages)."""

from __future__ import annotations

import collections

import torch

from backend.engine.sampling.drafters import HiddenStateDrafter, lookup_continuation
from backend.engine.sampling.speculative import verify
from backend.engine.sampling_params import SamplingParams
from backend.engine.sequence import Sequence

# --- units ---------------------------------------------------------------------------------------


def test_lookup_prefers_longest_most_recent_ngram():
    assert lookup_continuation([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], 3) == [7, 8, 5]  # "2 3" most recent
    assert lookup_continuation([5, 6, 7, 5, 6, 1, 4, 6], 2) == [1, 4]  # only "6" matches
    assert lookup_continuation([5, 6, 7, 8], 4) == [] and lookup_continuation([4, 4], 0) == []
    assert lookup_continuation([1, 2, 1, 2], 5) == [1, 2]  # continuation runs to the end of the context


def test_hidden_drafter_starts_from_the_hidden_states_logits():
    seq = Sequence("r", [3, 4, 5, 3, 4], SamplingParams(), None)
    assert HiddenStateDrafter().propose(seq, 3) == [5, 3, 4]  # no hidden state: plain lookup
    seq.last_logits = torch.zeros(16)
    seq.last_logits[11] = 1.0
    assert HiddenStateDrafter().propose(seq, 3)[0] == 11


def test_verify_greedy_accepts_the_matching_prefix_then_the_target_token():
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([2, 6, 1, 7]):
        logits[row, best] = 5.0
    greedy = SamplingParams()
    assert verify(logits, [2, 6, 1], greedy, None) == [2, 6, 1, 7]  # all accepted + bonus
    assert verify(logits, [2, 5, 1], greedy, None) == [2, 6]  # corrected at the mismatch
    assert verify(logits[:1], [], greedy, None) == [2]


def test_verify_sampling_keeps_the_target_distribution():
    """Point-mass drafts of any quality: the first emitted token is distributed as p."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0], [0.0] * 5])
    params = SamplingParams(temperature=1.0)
    p = logits[0].softmax(-1)
    generator = torch.Generator().manual_seed(7)
    n = 6000
    for draft in (0, 2):
        counts = collections.Counter(verify(logits, [draft], params, generator)[0] for _ in range(n))
        freq = torch.tensor([counts[t] / n for t in range(5)])
        assert torch.allclose(freq, p, atol=0.025), (draft, freq, p)


# --- real model ----------------------------------------------------------------------------------
