"""One client request's life on the response side: engine outputs -> text deltas -> sink.

Independent of Triton: a ``ResponseSink`` sends responses (the Triton adapter wraps a
response sender). Runs on the engine loop thread, so every method must be cheap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from backend.engine.outputs import ErrorKind, FinishReason
from backend.serving.detokenizer import IncrementalDetokenizer
from backend.serving.request import ClientRequest

log = logging.getLogger("triton_disagg.generation")


class ResponseSink(Protocol):
    def send(
        self, text: str, token_ids: list[int], n_input: int, n_output: int, finish_reason: str, final: bool
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
    ) -> None:
        """Called by the engine for every new token batch and once at the end."""
        if self.done:
            return
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
            else:  # a batch of k tokens (speculative decoding) after a gap: k tokens at gap/k each
                assert self.t_last is not None  # set with t_first
                self.token_gaps.extend([(now - self.t_last) / len(token_ids)] * len(token_ids))
            self.t_last = now
        self.n_output += len(token_ids)
        delta = self.detok.add(token_ids, final=finished)
        if self.detok.stopped and not finished:
            self.cancel_engine(self.req_id)
            finished, finish_reason = True, FinishReason.STOP
        try:
            if self.request.stream:
                if delta or token_ids or finished:
                    self.sink.send(delta, token_ids, self.n_input, self.n_output, finish_reason or "", finished)
            else:
                self._pending_text.append(delta)
                self._pending_ids.extend(token_ids)
                if finished:
                    self.sink.send(
                        "".join(self._pending_text),
                        self._pending_ids,
                        self.n_input,
                        self.n_output,
                        finish_reason or "",
                        True,
                    )
        except Exception as e:  # the client went away: stop generating for it
            log.warning("request %s: sending failed (%s); cancelling", self.req_id, e)
            self.cancel_engine(self.req_id)
            self._close("send-failed")
            return
        if finished:
            self._close(finish_reason or "stop")

    def _finish_error(self, message: str, kind: ErrorKind) -> None:
        log.error("request %s failed (%s): %s", self.req_id, kind, message)
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
        if self.on_done:
            self.on_done(self, reason)
