"""One client request's life on the response side: engine outputs -> text deltas -> sink.

Independent of Triton: a ``ResponseSink`` sends responses (the Triton adapter wraps a
response sender). Runs on the engine loop thread, so every method must be cheap. ``span``: the
request's trace span in this instance (``backend/cluster/tracing.py``; it records its first token
and ends with the request).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from backend.cluster.tracing import NO_SPAN, Span
from backend.engine.outputs import ErrorKind, FinishReason, TokenLogprobs
from backend.serving.detokenizer import IncrementalDetokenizer
from backend.serving.perf_metrics import RequestFigures
from backend.serving.request import ClientRequest
from backend.serving.tensors import PERF_OUTPUT

log = logging.getLogger("triton_disagg.generation")


# Extra output tensors of one response by name (log-probabilities: ``tensors.LOGPROB_OUTPUTS``).
Extras = dict[str, np.ndarray]


class ResponseSink(Protocol):
    def send(
        self,
        text: str,
        token_ids: list[int],
        n_input: int,
        n_output: int,
        finish_reason: str,
        final: bool,
        extras: Extras | None = None,
    ) -> None: ...
    def error(self, message: str, kind: ErrorKind) -> None: ...
    def close(self) -> None: ...
    def is_cancelled(self) -> bool: ...


@dataclass
class GenerationSession:
    req_id: str
    request: ClientRequest
    prompt_ids: list[int]
    sink: ResponseSink
    detok: IncrementalDetokenizer
    cancel_engine: Callable[[str], None]
    on_done: Callable[["GenerationSession", str], None] | None = None
    resumed: int = 0  # the last ``resumed`` prompt ids are output the client has already (migration)
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_last: float | None = None  # when the last token batch arrived
    t_end: float | None = None
    token_gaps: list = field(default_factory=list)  # inter-token latency of each token after the first
    n_output: int = 0
    done: bool = False
    cancelled: bool = False  # set when a cancel arrives by another path than the sink
    triton_id: str = ""  # the Triton request id, when the sender set one
    _pending_text: list = field(default_factory=list)
    _pending_ids: list = field(default_factory=list)
    _pending_logprobs: list = field(default_factory=list)  # TokenLogprobs of the unsent tokens
    _prompt_extras: Extras | None = None  # the prompt's log-probabilities, until the first response
    cum_logprob: float = 0.0
    span: Span = NO_SPAN
    error: str = ""  # why it failed, once it did
    figures: RequestFigures = field(default_factory=RequestFigures)  # its own, filled by the worker
    _final_ns: int | None = None  # time.time_ns() as the final response left: where the span ends

    def __post_init__(self) -> None:
        self.n_output = self.resumed  # num_output_tokens counts the whole output

    @property
    def n_input(self) -> int:
        """The client's prompt tokens (without the resumed output)."""
        return len(self.prompt_ids) - self.resumed

    def is_cancelled(self) -> bool:
        return self.cancelled or self.sink.is_cancelled()

    def fail(self, message: str, kind: ErrorKind) -> None:
        """End the request with an error of a known kind (admission, transfer, instance down)."""
        self.on_output([], True, FinishReason.ERROR, message, kind)

    def on_output(
        self,
        token_ids: list[int],
        finished: bool,
        finish_reason: str | None,
        error: str | None = None,
        error_kind: ErrorKind | None = None,
        logprobs: TokenLogprobs | None = None,
        prompt_logprobs: TokenLogprobs | None = None,
    ) -> None:
        """Called by the engine for every new token batch and once at the end (with the
        log-probabilities of the batch's tokens, and once of the prompt's, when asked for)."""
        if self.done:
            return
        if self.request.score_only and not error:  # the one token of its step is not output
            token_ids, logprobs = [], None
            if finished:
                finish_reason = FinishReason.LENGTH
        if prompt_logprobs is not None and self.request.return_prompt_log_probs:
            self._prompt_extras = _arrays("prompt", prompt_logprobs, self.request.num_top_log_probs)
            self._prompt_extras["prompt_token_ids"] = np.asarray(self.prompt_ids, dtype=np.int32)
        if logprobs is not None and self.request.return_log_probs:
            self._pending_logprobs.append(logprobs)
        if error:
            self._finish_error(error, error_kind or ErrorKind.INTERNAL)
            return
        if self.is_cancelled():
            log.info("request %s cancelled by the client after %d tokens", self.req_id, self.n_output)
            self.cancel_engine(self.req_id)
            self._close("cancelled")
            return
        if token_ids:
            now = time.perf_counter()
            if self.t_first is None:
                self.t_first = now
                self.span.event("first_token")
            else:  # a batch of k tokens (speculative decoding) after a gap: k tokens at gap/k each
                assert self.t_last is not None  # set with t_first
                self.token_gaps.extend([(now - self.t_last) / len(token_ids)] * len(token_ids))
            self.t_last = now
        self.n_output += len(token_ids)
        delta = self.detok.add(token_ids, final=finished)
        if self.detok.stopped and not finished:
            self.cancel_engine(self.req_id)
            finished, finish_reason = True, FinishReason.STOP
        if finished:  # the request's span ends as its last response leaves, not after it arrived
            self._final_ns = time.time_ns()
        try:
            if self.request.stream:
                if delta or token_ids or finished:
                    self._send(delta, token_ids, finish_reason, finished)
            else:
                self._pending_text.append(delta)
                self._pending_ids.extend(token_ids)
                if finished:
                    self._send("".join(self._pending_text), self._pending_ids, finish_reason, True)
        except Exception as e:  # the client went away: stop generating for it
            log.warning("request %s: sending failed (%s); cancelling", self.req_id, e)
            self.cancel_engine(self.req_id)
            self._close("send-failed")
            return
        if finished:
            self._close(finish_reason or "stop")

    def _send(self, text: str, token_ids: list[int], finish_reason: str | None, final: bool) -> None:
        """One response, with the log-probabilities not sent yet (the prompt's in the first)."""
        extras: Extras = {}
        if self._prompt_extras is not None:
            extras, self._prompt_extras = self._prompt_extras, None
        if self.request.return_log_probs:
            parts, self._pending_logprobs = self._pending_logprobs, []
            k = self.request.num_top_log_probs
            if parts:
                lp = TokenLogprobs.cat(parts) if len(parts) > 1 else parts[0]
                extras.update(_arrays("output", lp, k))
                self.cum_logprob += float(lp.logprobs.double().sum())
            else:
                extras.update(_arrays("output", None, k))
            extras["cum_log_probs"] = np.array([self.cum_logprob], dtype=np.float32)
        if final and self.request.return_perf_metrics:
            now, f = time.perf_counter(), self.figures
            f.prompt_tokens, f.output_tokens, f.e2e_s = self.n_input, self.n_output, now - self.t_start
            if self.t_first is not None:
                f.ttft_s = self.t_first - self.t_start
            extras[PERF_OUTPUT] = np.array([f.to_json().encode()], dtype=object)
        self.sink.send(text, token_ids, self.n_input, self.n_output, finish_reason or "", final, extras or None)

    def _finish_error(self, message: str, kind: ErrorKind) -> None:
        log.error("request %s failed (%s): %s", self.req_id, kind, message)
        self.error = f"{kind}: {message}"
        try:
            self.sink.error(message, kind)
        except Exception as e:
            log.warning("request %s: could not send error (%s)", self.req_id, e)
        self._close("error")

    def _close(self, reason: str) -> None:
        self.done = True
        self.t_end = time.perf_counter()
        if reason in ("cancelled", "send-failed"):
            try:  # end the stream: a caller waiting for the final response (the front model) stops
                self.sink.close()
            except Exception as e:
                log.debug("request %s: closing its stream: %s", self.req_id, e)
        if reason not in ("cancelled", "send-failed", "error"):
            ttft = (self.t_first - self.t_start) if self.t_first else float("nan")
            log.info(
                "request %s done: %s, %d prompt + %d output tokens, ttft %.3fs, total %.3fs",
                self.req_id,
                reason,
                len(self.prompt_ids),
                self.n_output,
                ttft,
                time.perf_counter() - self.t_start,
            )
        self.span.set(
            {
                "gen_ai.usage.input_tokens": self.n_input,
                "gen_ai.usage.output_tokens": self.n_output,
                "gen_ai.response.finish_reasons": [reason],
                "triton_disagg.ttft_s": (self.t_first - self.t_start) if self.t_first else -1.0,
            }
        )
        self.span.end(
            error=self.error or ("the response could not be sent" if reason == "send-failed" else None),
            at_ns=self._final_ns,
        )
        if self.on_done:
            self.on_done(self, reason)


def _arrays(prefix: str, lp: TokenLogprobs | None, k: int) -> Extras:
    """``<prefix>_log_probs`` [n] and, with ``k`` > 0, ``<prefix>_top_log_probs`` /
    ``<prefix>_top_token_ids`` [n * k] (row-major) as the response tensors carry them."""
    if lp is None:
        out: Extras = {f"{prefix}_log_probs": np.zeros(0, dtype=np.float32)}
        if k:
            out[f"{prefix}_top_log_probs"] = np.zeros(0, dtype=np.float32)
            out[f"{prefix}_top_token_ids"] = np.zeros(0, dtype=np.int32)
        return out
    out = {f"{prefix}_log_probs": lp.logprobs.numpy().astype(np.float32)}
    if k:
        out[f"{prefix}_top_log_probs"] = lp.top_logprobs.numpy().astype(np.float32).reshape(-1)
        out[f"{prefix}_top_token_ids"] = lp.top_ids.numpy().astype(np.int32).reshape(-1)
    return out
