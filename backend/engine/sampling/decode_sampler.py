"""Decode-side token choice: draft proposals before a step, then grammar masking and
verification (or plain sampling) of each sequence's logits after the forward pass.

Before scheduling, each decoding sequence with ``num_draft_tokens`` > 0 gets up to that many
drafts (bounded by max_tokens and the context) from its drafter; under a grammar the drafts are
cut at the first token it rejects and one bitmask row per chunk position is kept. After the
forward pass :meth:`DecodeSampler.pick` masks the chunk's logits rows (grammar) and verifies
the drafts (``backend/engine/sampling/speculative.py``), returning the accepted drafts plus one target token.
A request whose drafts keep failing stops drafting for a growing number of steps.
"""

from __future__ import annotations

import torch

from backend.engine.sampling.drafters import make_drafters
from backend.engine.sampling.speculative import verify
from backend.engine.scheduler import ScheduledChunk
from backend.engine.sequence import Sequence


class DecodeSampler:
    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len
        self.drafters = make_drafters()

    def propose(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.draft_pause:  # drafts kept failing: plain steps for a while
                seq.draft_pause -= 1
                seq.draft_token_ids = []
                continue
            k = seq.max_draft_tokens(self.max_model_len)
            drafts = self.drafters[seq.params.draft_method].propose(seq, k) if k else []
            if drafts and seq.grammar is not None:
                drafts, seq.draft_bitmask = seq.grammar.check_drafts(drafts)
            seq.draft_token_ids = drafts

    def pick(self, chunk: ScheduledChunk, logits: torch.Tensor) -> list[int]:
        """``logits`` [1 + len(drafts), vocab]: rows of the chunk's last token and its drafts."""
        seq, drafts = chunk.seq, chunk.draft_token_ids
        if seq.grammar is not None:
            bitmask = seq.draft_bitmask if drafts else seq.grammar.check_drafts([])[1]
            assert bitmask is not None  # propose() set draft_bitmask with the drafts
            logits = seq.grammar.mask(logits, bitmask[: len(drafts) + 1])
        tokens = verify(logits, drafts, seq.params, seq.generator)
        if drafts:
            self._adapt(seq, accepted=len(tokens) - 1)
        return tokens

    @staticmethod
    def _adapt(seq: Sequence, accepted: int) -> None:
        """Back off from drafting when drafts keep being rejected: a verify step costs more than a
        plain step, so after 3 straight misses a request pauses drafting for 2, 4, .. 16 steps."""
        if accepted:
            seq.draft_misses = 0
            return
        seq.draft_misses += 1
        if seq.draft_misses >= 3:
            seq.draft_pause = min(16, 2 ** (seq.draft_misses - 2))

    @staticmethod
    def clear(seq: Sequence) -> None:
        seq.draft_token_ids = []
        seq.draft_bitmask = None
