"""One generation against Triton over gRPC streaming (tritonclient's asyncio client): the
request's tensors (the prompt as ``text_input`` or as token ids, ``input_ids``; with
``resume_token_ids`` when a request continues on another decode instance), and the responses as
:class:`Delta` values, with the log-probabilities the request asked for; and a decode model's
readiness (:meth:`TritonStream.model_ready`, Triton's own ``ModelReady``). Closing the iterator before the
request finished (a client that went away) cancels the gRPC call, which Triton passes to the
model as a cancellation, so the request's KV pages go back to the pool. A finished request's call
is left to end by itself: cancelling a call whose final response Triton is still writing leaves
that response in Triton's gRPC handler, holding the model, which then cannot unload."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from backend.cluster.tracing import TRACE_HEADER
from backend.engine.outputs import ErrorKind
from backend.serving.errors import parse_error


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


def _tensor(name: str, values, triton_type: str, np_type) -> InferInput:
    arr = np.array(values, dtype=np_type)
    t = InferInput(name, list(arr.shape), triton_type)
    t.set_data_from_numpy(arr)
    return t


def build_inputs(
    prompt: str | list[int], params: GenerationParams, resume_token_ids: list[int] | None = None
) -> list[InferInput]:
    """The request's tensors; ``prompt``: text, or token ids (``input_ids``)."""
    if isinstance(prompt, str):
        first = _tensor("text_input", [prompt.encode("utf-8")], "BYTES", object)
    else:
        first = _tensor("input_ids", prompt, "INT32", np.int32)
    ins = [
        first,
        _tensor("max_tokens", [params.max_tokens], "INT32", np.int32),
        _tensor("stream", [True], "BOOL", bool),
        _tensor("temperature", [params.temperature], "FP32", np.float32),
    ]
    if params.top_p is not None:
        ins.append(_tensor("top_p", [params.top_p], "FP32", np.float32))
    if params.seed is not None:
        ins.append(_tensor("random_seed", [params.seed], "UINT64", np.uint64))
    if params.ignore_eos:
        ins.append(_tensor("ignore_eos", [True], "BOOL", bool))
    if params.min_tokens:
        ins.append(_tensor("min_length", [params.min_tokens], "INT32", np.int32))
    if params.stop:
        ins.append(_tensor("stop_words", [w.encode("utf-8") for w in params.stop], "BYTES", object))
    if params.guided_json is not None:
        ins.append(_tensor("guided_json", [params.guided_json.encode("utf-8")], "BYTES", object))
    if params.cache_salt:
        ins.append(_tensor("cache_salt", [params.cache_salt.encode("utf-8")], "BYTES", object))
    if resume_token_ids:
        ins.append(_tensor("resume_token_ids", resume_token_ids, "INT32", np.int32))
    if params.log_probs:
        ins.append(_tensor("return_log_probs", [True], "BOOL", bool))
    if params.prompt_log_probs:
        ins.append(_tensor("return_prompt_log_probs", [True], "BOOL", bool))
    if params.num_top_log_probs and (params.log_probs or params.prompt_log_probs):
        ins.append(_tensor("num_top_log_probs", [params.num_top_log_probs], "INT32", np.int32))
    return ins


def _text(exc: grpc.RpcError | InferenceServerException) -> str:
    if isinstance(exc, InferenceServerException):
        return str(exc.message())
    details = getattr(exc, "details", None)
    return str(details() if callable(details) else exc)


def _ints(result, name: str) -> list[int]:
    arr = result.as_numpy(name)
    return [] if arr is None else [int(v) for v in arr.reshape(-1)]


def _floats(result, name: str) -> list[float] | None:
    arr = result.as_numpy(name)
    return None if arr is None else [float(v) for v in arr.reshape(-1)]


def _top(result, lp_name: str, id_name: str, positions: int) -> list[TopTokens] | None:
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


def _ints_or_none(result, name: str) -> list[int] | None:
    arr = result.as_numpy(name)
    return None if arr is None else [int(v) for v in arr.reshape(-1)]


def parse_delta(result) -> Delta:
    """One Triton response (``InferResult``-like: ``as_numpy(name)``, None for an output it
    does not carry) as a :class:`Delta`."""
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


def _scalar(result, name: str, default=None):
    arr = result.as_numpy(name)
    if arr is None or not arr.size:
        return default
    value = arr.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value


class TritonStream:
    """One gRPC channel to Triton, shared by every request of this frontend."""

    def __init__(self, url: str):
        self.url = url
        self.client = grpcaio.InferenceServerClient(url)

    async def ready(self, model: str) -> bool:
        try:
            return await self.client.is_server_ready() and await self.client.is_model_ready(model)
        except InferenceServerException:
            return False

    async def generate(
        self,
        model: str,
        prompt: str | list[int],
        params: GenerationParams,
        resume_token_ids: list[int] | None = None,
        traceparent: str = "",
    ) -> AsyncGenerator[Delta, None]:
        """Deltas until the one with a finish reason; :class:`GenerationError` for a refused or
        failed request (:class:`StreamLost` for a broken call). ``prompt``: text or token ids.
        ``resume_token_ids``: the output the client has already; the model continues after it.
        ``traceparent``: the caller's trace context (a request parameter). Closing the iterator
        early cancels the request in Triton."""
        inputs = build_inputs(prompt, params, resume_token_ids)
        request: dict[str, Any] = {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex}
        if traceparent:
            request["parameters"] = {TRACE_HEADER: traceparent}

        async def one_request():
            yield request

        call = self.client.stream_infer(one_request())
        ended = False  # the final response or an error arrived: nothing left to cancel
        try:
            async for result, error in call:
                if error is not None:
                    ended = True
                    kind, message = parse_error(error.message())
                    raise GenerationError(kind, message)
                delta = parse_delta(result)
                ended = delta.finish_reason is not None
                yield delta
                if ended:
                    return
            ended = True
            raise StreamLost(ErrorKind.INTERNAL, f"Triton at {self.url} closed the stream before the request finished")
        except (grpc.RpcError, InferenceServerException) as exc:
            ended = True
            raise StreamLost(ErrorKind.OUT_OF_SERVICE, f"Triton at {self.url} failed the call: {_text(exc)}") from exc
        finally:
            if not ended or not await _ended_by_server(call):
                call.cancel()

    async def model_ready(self, model: str, timeout_s: float) -> None:
        """Returns when Triton has decode model ``model`` ready; :class:`GenerationError` when it
        answers that it is not, :class:`StreamLost` when it cannot be reached or does not answer
        within ``timeout_s``."""
        try:
            ready = await asyncio.wait_for(self.client.is_model_ready(model, client_timeout=timeout_s), timeout_s)
        except TimeoutError:
            raise StreamLost(ErrorKind.OUT_OF_SERVICE, f"no readiness answer within {timeout_s:g}s") from None
        except (grpc.RpcError, InferenceServerException) as exc:
            raise StreamLost(ErrorKind.OUT_OF_SERVICE, f"Triton at {self.url} failed the probe: {_text(exc)}") from exc
        if not ready:
            raise GenerationError(ErrorKind.OUT_OF_SERVICE, f"Triton at {self.url}: decode model {model} is not ready")

    async def close(self) -> None:
        await self.client.close()


async def _ended_by_server(call, timeout_s: float = 5.0) -> bool:
    """Wait for Triton to end a call whose request finished (its request stream is closed, so
    the server ends the call once its last response is out). False if it did not in time."""

    async def rest():
        async for _ in call:
            pass

    try:
        await asyncio.wait_for(rest(), timeout_s)
        return True
    except (TimeoutError, grpc.RpcError, InferenceServerException):
        return False
