"""Continuous-batching scheduler with chunked prefill.

Each step takes, within the per-step token budget and in this order: one token for every running
sequence that is decoding; the next prefill chunk of running sequences that are part way through
their prompt; then waiting sequences (FIFO), admitted only while the pool can commit the pages
they may grow into; a sequence admitted with a cached prompt prefix (the allocator's prefix
cache) starts computing after it. Nothing is preempted: a sequence that does not fit waits at the queue head.
A decoding sequence with draft tokens (speculative decoding) runs its last token and its drafts
in one chunk, the drafts cut to the budget left.

Remote KV (decode role) goes through the same admission: a ``remote_kv`` sequence gets its pages
(its cached prefix first) like any other, then the KV loader (``load_remote``) decides whether the
rest of its prompt's KV comes from elsewhere; if so it waits, holding its pages, in
``WAITING_REMOTE_KV`` (``parked``; it takes no seat of ``max_num_seqs``) until :meth:`kv_loaded`
queues it in ``ready``: at its last prompt token, admitted before the waiting queue when a seat is
free.

KV tiers: a sequence admitted with blocks of its prefix in the tiers below the pool
(``PageAllocator.tier_loads``) waits in ``WAITING_TIER_KV`` (``tier_parked``, no seat) while
``load_tiers`` copies them; :meth:`tier_loaded` then sends it on as if it had just been admitted
with those tokens cached (a ``remote_kv`` sequence goes to its KV loader next).

A sequence whose prefix the shared KV tier may hold is added with ``look_up``: it waits in
``WAITING_TIER_LOOKUP`` (``looking_up``, no pages, no seat) while the store is asked (off the
engine's thread) and joins the waiting queue at :meth:`looked_up`.

``stalled``: the last :meth:`schedule` found nothing to run (the engine loop then waits for a
command instead of spinning: only a command, or the tier loader's wake-up, can free pages or
seats then).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from backend.engine.page_allocator import PageAllocator, PoolFullError
from backend.engine.sequence import SeqStatus, Sequence

log = logging.getLogger("triton_disagg.engine")


@dataclass
class ScheduledChunk:
    """Tokens ``start .. start+num_tokens-1`` of ``seq`` run this step, followed by
    ``draft_token_ids`` (not yet part of the sequence) when it speculates."""

    seq: Sequence
    start: int
    num_tokens: int
    page_table: list[int]
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def is_last_chunk(self) -> bool:
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def input_token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.num_tokens] + self.draft_token_ids

    def touched_page_ids(self, page_size: int) -> list[int]:
        first = self.start // page_size
        last = (self.start + len(self.input_token_ids) - 1) // page_size
        return self.page_table[first : last + 1]


@dataclass
class ChunkInfo:
    """What the hooks see of one sequence's share of a step."""

    req_id: str
    start: int
    num_tokens: int
    page_ids: list[int]
    is_last_chunk: bool
    prefill_only: bool


@dataclass
class StepBatch:
    """What a KV step listener is told (``step_scheduled`` and ``layer_written``): the chunks of this step."""

    chunks: list[ChunkInfo]

    @property
    def prefill_only_chunks(self) -> list[ChunkInfo]:
        return [c for c in self.chunks if c.prefill_only]


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: dict[str, Sequence] = {}  # WAITING_REMOTE_KV
        self.tier_parked: dict[str, Sequence] = {}  # WAITING_TIER_KV
        self.looking_up: dict[str, Sequence] = {}  # WAITING_TIER_LOOKUP
        self.ready: deque[Sequence] = deque()  # remote KV landed, waiting for a seat (pages held)
        self.stalled = False
        # (seq) -> True when its prompt's KV will be loaded from elsewhere (it then waits)
        self.load_remote: Callable[[Sequence], bool] | None = None
        # (seq) -> start loading the tier blocks the allocator found for it (see tier_loaded)
        self.load_tiers: Callable[[Sequence], None] | None = None

    def add(self, seq: Sequence, look_up: bool = False) -> None:
        """Queue ``seq``; with ``look_up`` it waits for :meth:`looked_up` first."""
        if look_up:
            seq.status = SeqStatus.WAITING_TIER_LOOKUP
            self.looking_up[seq.req_id] = seq
        else:
            self.waiting.append(seq)

    def looked_up(self, seq: Sequence) -> None:
        """The shared tier answered for ``seq``'s prefix (or was not waited for longer): it queues."""
        if seq.status is not SeqStatus.WAITING_TIER_LOOKUP:
            raise ValueError(f"request {seq.req_id!r} is not waiting for a tier lookup ({seq.status.value})")
        del self.looking_up[seq.req_id]
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """Something to compute (waiting for remote KV is not)."""
        return bool(self.waiting or self.running or self.ready)

    def remove(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.WAITING:
            (self.ready if seq in self.ready else self.waiting).remove(seq)
        elif seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING_REMOTE_KV:
            del self.parked[seq.req_id]
        elif seq.status is SeqStatus.WAITING_TIER_KV:
            del self.tier_parked[seq.req_id]
        elif seq.status is SeqStatus.WAITING_TIER_LOOKUP:
            del self.looking_up[seq.req_id]
        seq.status = SeqStatus.FINISHED

    def tier_loaded(self, seq: Sequence) -> None:
        """A sequence's tier blocks are in its pages (as many as loaded: the allocator counts them
        as cached tokens): it goes on from its cached prefix."""
        if seq.status is not SeqStatus.WAITING_TIER_KV:
            raise ValueError(f"request {seq.req_id!r} is not waiting for tier KV ({seq.status.value})")
        del self.tier_parked[seq.req_id]
        seq.num_computed = self.allocator.cached_tokens(seq.req_id)
        if not self._parked_for_remote_kv(seq):
            seq.status = SeqStatus.WAITING
            self.ready.append(seq)

    def kv_loaded(self, seq: Sequence) -> None:
        """A parked sequence's prompt KV (all tokens but the last) is in its pages: it runs its last
        prompt token as its first decode step."""
        if seq.status is not SeqStatus.WAITING_REMOTE_KV:
            raise ValueError(f"request {seq.req_id!r} is not waiting for remote KV ({seq.status.value})")
        del self.parked[seq.req_id]
        seq.num_computed = seq.num_tokens - 1
        seq.status = SeqStatus.WAITING
        self.ready.append(seq)

    def compute_here(self, seq: Sequence) -> None:
        """A parked sequence's remote KV will not come: it prefills here from its cached prefix
        (pages a failed transfer may have written into are recomputed), with the pages it holds."""
        if seq.status is not SeqStatus.WAITING_REMOTE_KV:
            raise ValueError(f"request {seq.req_id!r} is not waiting for remote KV ({seq.status.value})")
        del self.parked[seq.req_id]
        seq.num_computed = self.allocator.cached_tokens(seq.req_id)
        seq.status = SeqStatus.WAITING
        self.ready.append(seq)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        decoding = [s for s in self.running if s.num_uncomputed == 1]
        prefilling = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decoding + prefilling:
            if budget == 0:
                return chunks
            chunks.append(self._chunk(seq, budget))
            budget -= len(chunks[-1].input_token_ids)
        while self.ready and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.ready.popleft()  # its pages are allocated and committed already
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, budget))
            budget -= len(chunks[-1].input_token_ids)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            if self.load_tiers is not None and self.allocator.tier_loads(seq.req_id):
                seq.status = SeqStatus.WAITING_TIER_KV
                self.tier_parked[seq.req_id] = seq
                self.load_tiers(seq)
                continue
            if self._parked_for_remote_kv(seq):
                continue
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, budget))
            budget -= len(chunks[-1].input_token_ids)
        self.stalled = not chunks
        return chunks

    def _parked_for_remote_kv(self, seq: Sequence) -> bool:
        """A ``remote_kv`` sequence whose KV loader takes it waits in ``WAITING_REMOTE_KV``."""
        if seq.remote_kv and self._load_remote(seq):
            seq.status = SeqStatus.WAITING_REMOTE_KV
            self.parked[seq.req_id] = seq
            return True
        return False

    def _load_remote(self, seq: Sequence) -> bool:
        """Ask the KV loader; one that raises leaves the request to be computed here."""
        if self.load_remote is None:
            return False
        try:
            return self.load_remote(seq)
        except Exception:
            log.exception("KV loader failed for %s; computing its prompt here", seq.req_id)
            return False

    def _admit(self, seq: Sequence) -> bool:
        commit_tokens = seq.kv_tokens_needed(self.max_model_len)
        try:
            # a request that wants its prompt's log-probabilities needs the logits of every prompt
            # position: it attaches no cached prefix
            prefix = None if seq.wants_prompt_logprobs else seq.token_ids
            self.allocator.allocate(
                seq.req_id, seq.num_tokens, commit_tokens, token_ids=prefix, cache_salt=seq.cache_salt
            )
            seq.num_computed = self.allocator.cached_tokens(seq.req_id)  # a cached prefix is not recomputed
        except PoolFullError:
            return False
        return True

    def _chunk(self, seq: Sequence, budget: int) -> ScheduledChunk:
        start = seq.num_computed
        num_tokens = min(seq.num_uncomputed, budget)
        drafts = seq.draft_token_ids[: budget - 1] if seq.num_uncomputed == 1 else []
        self.allocator.extend(seq.req_id, start + num_tokens + len(drafts))
        return ScheduledChunk(seq, start, num_tokens, self.allocator.page_table(seq.req_id), drafts)
