"""The OpenAI frontend's thin async adapter over the shared stream client
(``backend/serving/decode_stream.py``, the Triton front model's too): one generation against
Triton over a gRPC stream, the request's tensors (the prompt as ``text_input`` or as token ids,
``input_ids``; with ``resume_token_ids`` when a request continues on another decode instance) in,
the responses out as :class:`Delta` values, with the log-probabilities the request asked for; and
a model's readiness (Triton's own ``ModelReady``). The stream's replies are read on a thread of
their own and handed to the event loop. Closing the iterator before the request finished (a
client that went away) cancels the gRPC call, which Triton passes to the model as a
cancellation, so the request's KV pages go back to the pool. A finished request's call is left to
end by itself: cancelling a call whose final response Triton is still writing leaves that
response in Triton's gRPC handler, holding the model, which then cannot unload."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import uuid
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field

import numpy as np

from backend.engine.outputs import ErrorKind
from backend.serving.decode_stream import Attempt, GrpcLink, Reply
from backend.serving.errors import parse_error
from backend.serving.routing import Target


@dataclass
class GenerationParams:
    max_tokens: int
    temperature: float
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    guided_json: str | None = None
    log_probs: bool = False  # each output token's log-probability
    prompt_log_probs: bool = False  # the prompt's (first response); max_tokens may then be 0
    num_top_log_probs: int = 0  # with either: the k most likely tokens at each position
    cache_salt: str = ""  # the prefix-cache tenant ("": shared)


# the k most likely tokens at one position, most likely first: (token id, log-probability)
TopTokens = list[tuple[int, float]]


@dataclass
class Delta:
    text: str
    num_input_tokens: int
    num_output_tokens: int
    finish_reason: str | None  # set on the last response
    token_ids: list[int] = field(default_factory=list)  # the output tokens of this response
    # asked for with GenerationParams.log_probs: one per token of token_ids (top: k per token)
    log_probs: list[float] | None = None
    top_log_probs: list[TopTokens] | None = None
    # asked for with GenerationParams.prompt_log_probs, in the first response: the prompt's
    # tokens, and the log-probabilities of its tokens 2..P (the first has no context)
    prompt_token_ids: list[int] | None = None
    prompt_log_probs: list[float] | None = None
    prompt_top_log_probs: list[TopTokens] | None = None

    def without_prompt(self) -> Delta:
        """This delta without the prompt's log-probabilities (a client gets them once)."""
        return dataclasses.replace(self, prompt_token_ids=None, prompt_log_probs=None, prompt_top_log_probs=None)


class GenerationError(Exception):
    """Triton refused or failed the request; ``kind`` is our error kind when the model named it."""

    def __init__(self, kind: ErrorKind | None, message: str):
        super().__init__(message)
        self.kind, self.message = kind, message


class StreamLost(GenerationError):
    """The call broke (gRPC error: unreachable, connection lost) or ended before its final
    response: nothing was said about the request itself, so it may continue elsewhere."""


def build_inputs(
    prompt: str | list[int], params: GenerationParams, resume_token_ids: list[int] | None = None
) -> dict[str, np.ndarray]:
    """The request's tensors (name -> array); ``prompt``: text, or token ids (``input_ids``)."""
    ins = {
        "text_input" if isinstance(prompt, str) else "input_ids": (
            np.array([prompt.encode("utf-8")], dtype=object)
            if isinstance(prompt, str)
            else np.array(prompt, dtype=np.int32)
        ),
        "max_tokens": np.array([params.max_tokens], dtype=np.int32),
        "stream": np.array([True], dtype=bool),
        "temperature": np.array([params.temperature], dtype=np.float32),
    }
    if params.top_p is not None:
        ins["top_p"] = np.array([params.top_p], dtype=np.float32)
    if params.seed is not None:
        ins["random_seed"] = np.array([params.seed], dtype=np.uint64)
    if params.ignore_eos:
        ins["ignore_eos"] = np.array([True], dtype=bool)
    if params.min_tokens:
        ins["min_length"] = np.array([params.min_tokens], dtype=np.int32)
    if params.stop:
        ins["stop_words"] = np.array([w.encode("utf-8") for w in params.stop], dtype=object)
    if params.guided_json is not None:
        ins["guided_json"] = np.array([params.guided_json.encode("utf-8")], dtype=object)
    if params.cache_salt:
        ins["cache_salt"] = np.array([params.cache_salt.encode("utf-8")], dtype=object)
    if resume_token_ids:
        ins["resume_token_ids"] = np.array(resume_token_ids, dtype=np.int32)
    if params.log_probs:
        ins["return_log_probs"] = np.array([True], dtype=bool)
    if params.prompt_log_probs:
        ins["return_prompt_log_probs"] = np.array([True], dtype=bool)
    if params.num_top_log_probs and (params.log_probs or params.prompt_log_probs):
        ins["num_top_log_probs"] = np.array([params.num_top_log_probs], dtype=np.int32)
    return ins


Outputs = Mapping[str, np.ndarray]  # one response's output arrays by name


def _ints(result: Outputs, name: str) -> list[int]:
    arr = result.get(name)
    return [] if arr is None else [int(v) for v in arr.reshape(-1)]


def _floats(result: Outputs, name: str) -> list[float] | None:
    arr = result.get(name)
    return None if arr is None else [float(v) for v in arr.reshape(-1)]


def _top(result: Outputs, lp_name: str, id_name: str, positions: int) -> list[TopTokens] | None:
    """``positions`` rows of (token id, log-prob) from the row-major tensors ``id_name`` and
    ``lp_name`` (k per position); None when the response has none."""
    lps, ids = _floats(result, lp_name), _ints_or_none(result, id_name)
    if lps is None or ids is None:
        return None
    if len(lps) != len(ids) or (positions and len(lps) % positions) or (not positions and lps):
        raise GenerationError(
            ErrorKind.INTERNAL, f"Triton sent {len(ids)} {id_name} and {len(lps)} {lp_name} for {positions} positions"
        )
    k = len(lps) // positions if positions else 0
    return [list(zip(ids[i * k : (i + 1) * k], lps[i * k : (i + 1) * k], strict=True)) for i in range(positions)]


def _ints_or_none(result: Outputs, name: str) -> list[int] | None:
    arr = result.get(name)
    return None if arr is None else [int(v) for v in arr.reshape(-1)]


def parse_delta(result: Outputs) -> Delta:
    """One Triton response (its output arrays by name) as a :class:`Delta`."""
    token_ids = _ints(result, "output_token_ids")
    prompt_ids = _ints_or_none(result, "prompt_token_ids")
    prompt_positions = max(0, len(prompt_ids) - 1) if prompt_ids is not None else 0
    return Delta(
        text=_scalar(result, "text_output", ""),
        num_input_tokens=int(_scalar(result, "num_input_tokens", 0)),
        num_output_tokens=int(_scalar(result, "num_output_tokens", 0)),
        finish_reason=_scalar(result, "finish_reason", "") or None,
        token_ids=token_ids,
        log_probs=_floats(result, "output_log_probs"),
        top_log_probs=_top(result, "output_top_log_probs", "output_top_token_ids", len(token_ids)),
        prompt_token_ids=prompt_ids,
        prompt_log_probs=_floats(result, "prompt_log_probs"),
        prompt_top_log_probs=_top(result, "prompt_top_log_probs", "prompt_top_token_ids", prompt_positions),
    )


def _scalar(result: Outputs, name: str, default=None):
    arr = result.get(name)
    if arr is None or not arr.size:
        return default
    value = arr.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value


class TritonStream:
    """Triton at ``url``, for every request of this frontend to it."""

    def __init__(self, url: str, probe_timeout_s: float = 5.0):
        self.url, self.probe_timeout_s = url, probe_timeout_s
        self._probes: dict[str, GrpcLink] = {}

    def _link(self, model: str) -> GrpcLink:
        return GrpcLink(Target(model, self.url, model), self.probe_timeout_s)

    async def ready(self, model: str) -> bool:
        """Whether Triton has ``model`` ready (one probe channel per model, kept)."""
        link = self._probes.setdefault(model, self._link(model))
        return (await asyncio.to_thread(link.probe)).error is None

    async def generate(
        self,
        model: str,
        prompt: str | list[int],
        params: GenerationParams,
        resume_token_ids: list[int] | None = None,
        traceparent: str = "",
    ) -> AsyncGenerator[Delta, None]:
        """Deltas until the one with a finish reason; :class:`GenerationError` for a refused or
        failed request (:class:`StreamLost` for a call that could not start or that ended before
        its final response). ``prompt``: text or token ids. ``resume_token_ids``: the output the
        client has already; the model continues after it. ``traceparent``: the caller's trace
        context (a request parameter). Closing the iterator early cancels the request in
        Triton."""
        inputs = build_inputs(prompt, params, resume_token_ids)
        attempt = self._link(model).open(uuid.uuid4().hex, inputs, traceparent)
        ended = False  # the final response or an error arrived: nothing left to cancel
        try:
            async for reply in _replies(attempt):
                if reply.error is not None:
                    ended = True
                    if reply.unanswered:
                        raise StreamLost(ErrorKind.OUT_OF_SERVICE, reply.error)
                    raise GenerationError(*parse_error(reply.error))
                delta = parse_delta(reply.outputs)
                ended = delta.finish_reason is not None
                yield delta
                if ended:
                    return
            ended = True
            raise StreamLost(ErrorKind.INTERNAL, f"Triton at {self.url} closed the stream before the request finished")
        finally:
            if ended:
                attempt.finish()
            else:
                attempt.cancel()

    async def close(self) -> None:
        for link in self._probes.values():
            await asyncio.to_thread(link.close)


_END = object()


async def _replies(attempt: Attempt) -> AsyncGenerator[Reply, None]:
    """``attempt``'s replies, read on a thread of their own (each stream blocks while it waits
    for its next token) and handed to the event loop."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def put(item: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: shutting down
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def read() -> None:
        try:
            for reply in attempt.replies():
                put(reply)
        except Exception as e:  # the client library failed: a broken call
            put(Reply(error=f"{type(e).__name__}: {e}", unanswered=True))
        finally:
            put(_END)

    threading.Thread(target=read, name="openai-stream", daemon=True).start()
    while (item := await queue.get()) is not _END:
        yield item
