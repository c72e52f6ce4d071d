"""What the engine hands back: a request's new tokens per step (:class:`EngineOutput`), their
log-probabilities when asked for (:class:`TokenLogprobs`), why it ended (:class:`FinishReason`)
and, for failures, what kind of failure (:class:`ErrorKind`).
The kinds travel between processes (messenger messages, Triton errors) as their string
values and are read back into the enum, never matched in message texts."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an end id, a stop sequence or a complete grammar
    LENGTH = "length"  # max_tokens or the context is reached
    ABORT = "abort"  # cancelled
    ERROR = "error"  # failed; see ``error`` and ``error_kind``
    PREFILL_DONE = "prefill_done"  # prefill role: the prompt's KV is computed (nothing sampled)


class ErrorKind(enum.StrEnum):
    BAD_REQUEST = "bad_request"  # the request itself is invalid
    OVERLOADED = "overloaded"  # queue or KV pool full: retry later
    OUT_OF_SERVICE = "out_of_service"  # the instance is down (e.g. lost a TP rank)
    DRAINING = "draining"  # the instance takes no new requests; the ones it has go on
    PREFILL_UNAVAILABLE = "prefill_unavailable"  # no prefill instance reachable
    KV_TRANSFER_FAILED = "kv_transfer_failed"  # the prompt's KV did not arrive
    ENGINE = "engine"  # a model step failed
    INTERNAL = "internal"  # a bug: see the instance's log


@dataclass
class TokenLogprobs:
    """Log-probabilities of a run of tokens: ``logprobs[i]`` of token i at its position and, when
    top-k was asked for, the k most likely tokens there (``top_ids[i]``, most likely first) and
    theirs (``top_logprobs[i]``). Always ``log_softmax`` of the model's raw logits in float32
    (before temperature, top-k/top-p, grammar or min_tokens masks); a token's own value and its
    entry among the top-k come from the same tensor (a greedy token's equals the top-1 value)."""

    logprobs: torch.Tensor  # [n] float32
    top_ids: torch.Tensor  # [n, k] int64 (k may be 0)
    top_logprobs: torch.Tensor  # [n, k] float32

    def __len__(self) -> int:
        return int(self.logprobs.shape[0])

    @staticmethod
    def cat(parts: list[TokenLogprobs]) -> TokenLogprobs:
        import torch

        return TokenLogprobs(
            torch.cat([p.logprobs for p in parts]),
            torch.cat([p.top_ids for p in parts]),
            torch.cat([p.top_logprobs for p in parts]),
        )


@dataclass
class EngineOutput:
    """New tokens of one request from one step; ``finished`` with ``finish_reason``.
    Prefill-only results carry ``hidden_state`` [hidden] and ``logits`` [vocab] of the last
    prompt position. ``pages_held``: the request ended but keeps its pages (a prefill-only request,
    or one that waited for remote KV: a transfer may still read or write them) until the engine is
    told to release them. ``logprobs``: of ``new_token_ids`` (``SamplingParams.logprobs``);
    ``prompt_logprobs``: of the prompt's tokens 2..P (``SamplingParams.prompt_logprobs``), once,
    with the request's first output."""

    req_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    hidden_state: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    pages_held: bool = False
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
