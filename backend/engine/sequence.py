"""A request's state inside the engine: its tokens, how many have KV in the pool, and why it ended."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from backend.engine.outputs import FinishReason, TokenLogprobs
from backend.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued for pages (admission)
    WAITING_TIER_LOOKUP = "waiting_tier_lookup"  # not queued yet: the shared KV tier is asked for its prefix
    WAITING_TIER_KV = "waiting_tier_kv"  # has its pages; blocks of its prefix are loaded from the KV tiers
    WAITING_REMOTE_KV = "waiting_remote_kv"  # has its pages; its prompt's KV is loaded from elsewhere
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """``token_ids`` = prompt + generated tokens; ``num_computed`` of them have their KV in the pool.

    A prefill-only sequence (prefill role) computes its prompt and never samples. A ``remote_kv``
    sequence (decode role) may have its prompt's KV (all tokens but the last) loaded from elsewhere:
    once admitted with its pages, the engine's KV loader decides, and the sequence then waits in
    ``WAITING_REMOTE_KV`` until the KV has landed (it then starts at its last prompt token).

    Decode-side state: ``draft_token_ids`` (this step's proposal, with ``draft_bitmask`` when a
    ``grammar`` constrains the output), and ``last_hidden`` / ``last_logits`` of the sequence's last
    computed position (transferred with the KV, or kept from the last prefill chunk / decode step).
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        prefill_only: bool = False,
        remote_kv: bool = False,
    ):
        self.req_id = req_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.generator = generator
        self.prefill_only = prefill_only
        self.remote_kv = remote_kv
        self.num_computed = 0
        self.status = SeqStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.draft_token_ids: list[int] = []
        self.draft_bitmask: torch.Tensor | None = None
        self.draft_misses = 0  # consecutive verify steps that accepted no draft
        self.draft_pause = 0  # decode steps left without drafting (backoff after misses)
        self.grammar: Any = None  # a GrammarState (xgrammar), imported only when used
        self.last_hidden: torch.Tensor | None = None
        self.last_logits: torch.Tensor | None = None
        self.prompt_logprobs: list[TokenLogprobs] = []  # per prefill chunk, until the first output

    @property
    def cache_salt(self) -> str:
        return self.params.cache_salt

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and not self.prefill_only

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def max_draft_tokens(self, max_model_len: int) -> int:
        """Drafts this step may verify: never past max_tokens or the context (so never past the
        pages committed at admission)."""
        if self.prefill_only or self.num_uncomputed != 1:
            return 0
        return max(
            0,
            min(
                self.params.num_draft_tokens,
                self.params.max_tokens - self.num_output_tokens - 1,
                max_model_len - self.num_tokens - 1,
            ),
        )

    def kv_tokens_needed(self, max_model_len: int) -> int:
        """Most tokens this sequence can ever hold KV for (the last sampled token never needs KV)."""
        if self.prefill_only:
            return self.num_prompt_tokens
        return max(self.num_prompt_tokens, min(self.num_prompt_tokens + self.params.max_tokens, max_model_len) - 1)

    def check_stop(self, max_model_len: int) -> FinishReason | None:
        """Finish reason after a token was appended, or None to continue."""
        params = self.params
        last = self.token_ids[-1]
        if not params.ignore_eos and last in params.end_ids and self.num_output_tokens >= params.min_tokens:
            return FinishReason.STOP
        for stop in params.stop_token_ids:
            if self.num_output_tokens >= len(stop) and tuple(self.token_ids[-len(stop) :]) == stop:
                return FinishReason.STOP
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
