"""The OpenAI-compatible ASGI app (FastAPI): routes, streaming, errors.

A request is checked (pydantic schema, then :meth:`check_supported`), its model name mapped to
the Triton model, chat messages turned into a prompt by the model's own chat template, and the
generation run through :class:`TritonStream`. The first response from Triton is awaited before
the HTTP response starts, so a request Triton refuses gets its proper status (400 bad input,
429 overloaded, 503 out of service or no prefill instance) in OpenAI's error shape, streaming
or not. A streamed answer is server-sent events ending in ``data: [DONE]``; an error after the
first token arrives as one ``data: {"error": ...}`` event before ``[DONE]``. A client that
disconnects cancels its Triton request.

With ``discovery`` (an etcd URL) the frontend calls no ``llm`` model: :class:`DecodeFleet`
(``fleet.py``) keeps the deployment's decode instances from the membership and probes them, and
its :class:`Router` (``router.py``) picks one per request (KV-aware, from the prompt's tokens) and
moves the request to another when its instance stops serving it. ``GET /metrics``: the router's
counters (``metrics.py``).

Log-probabilities (a completion's ``logprobs`` and ``echo``, a chat's ``logprobs`` and
``top_logprobs``) are asked of Triton (``return_log_probs``, ``return_prompt_log_probs``,
``num_top_log_probs``) and shaped by ``logprobs.py`` with the model's tokenizer (``--tokenizer``;
without one such a request is refused). Each response's tokens carry theirs: a streamed chunk
holds those of its own tokens, and with ``echo`` the first chunk is the prompt (its text, and its
tokens' log-probabilities).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from backend.cluster.tracing import TRACE_HEADER, Span, start_tracing
from backend.engine.outputs import ErrorKind
from backend.openai.fleet import DecodeFleet
from backend.openai.logprobs import CompletionLogprobs, TokenTexts, chat_content
from backend.openai.metrics import CONTENT_TYPE, exposition
from backend.openai.router import Router
from backend.openai.schemas import (
    OPENAI_DEFAULT_TEMPERATURE,
    ChatCompletionRequest,
    CompletionRequest,
    UnsupportedField,
    error_body,
    usage,
)
from backend.openai.triton_stream import Delta, GenerationError, GenerationParams, TritonStream
from backend.serving.config import RouterSettings
from backend.serving.request import prompt_token_ids

log = logging.getLogger("triton_disagg.openai")

# our error kinds -> (HTTP status, OpenAI error type)
_STATUS: dict[ErrorKind | None, tuple[int, str]] = {
    ErrorKind.BAD_REQUEST: (400, "invalid_request_error"),
    ErrorKind.OVERLOADED: (429, "rate_limit_error"),
    ErrorKind.OUT_OF_SERVICE: (503, "service_unavailable"),
    ErrorKind.DRAINING: (503, "service_unavailable"),
    ErrorKind.PREFILL_UNAVAILABLE: (503, "service_unavailable"),
    ErrorKind.KV_TRANSFER_FAILED: (503, "service_unavailable"),
}


@dataclass(frozen=True)
class FrontendConfig:
    """``triton_url``: gRPC address of the deployment; ``triton_model``: the model to call
    (``llm``: the aggregated model or the disaggregated front); ``served_model_name``: the id
    clients use (also accepted: the Triton model's name); ``tokenizer``: directory of the
    model's tokenizer (its chat template); ``max_tokens_default``: a chat request without a
    limit gets this many tokens at most. ``discovery`` (``etcd://HOST:PORT``): route across the
    decode instances of ``deployment`` instead (records verified with ``secret``), probed,
    routed and moved by ``router``'s settings (the Triton front model's too). ``otlp_endpoint``:
    the OpenTelemetry collector it exports each request's spans to ("" : no tracing), as
    ``instance``."""

    triton_url: str
    triton_model: str = "llm"
    served_model_name: str = "llm"
    tokenizer: str | None = None
    max_tokens_default: int = 1024
    discovery: str = ""
    deployment: str = "default"
    secret: bytes = field(default=b"", repr=False)
    router: RouterSettings = field(default_factory=RouterSettings)
    otlp_endpoint: str = ""
    instance: str = "openai"


def _finish_reason(ours: str | None) -> str:
    return "length" if ours == "length" else "stop"


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param), status_code=status)


def _generation_error(exc: GenerationError) -> JSONResponse:
    status, type_ = _STATUS.get(exc.kind, (500, "server_error"))
    if exc.kind is None and "unknown model" in exc.message.lower():
        status, type_ = 503, "service_unavailable"  # the deployment does not serve the model (yet)
    return _error(status, exc.message, type_)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class BadLogprobs(GenerationError):
    """Triton's log-probabilities do not fit its tokens (a server bug: HTTP 500)."""

    def __init__(self, message: str):
        super().__init__(ErrorKind.INTERNAL, f"log-probabilities: {message}")


class _Answer:
    """The pieces an endpoint shapes into its OpenAI objects. ``echo``: a completion's prompt
    text, which its answer starts with; ``completion_logprobs``: a completion's log-probabilities
    (with ``echo``, the prompt's first); ``chat_top``: a chat's number of top tokens when it
    asked for log-probabilities; ``texts``: token texts, with either."""

    def __init__(
        self,
        kind: str,
        model: str,
        *,
        echo: str | None = None,
        completion_logprobs: bool = False,
        chat_top: int | None = None,
        texts: TokenTexts | None = None,
    ):
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.echo, self.chat_top, self.texts = echo, chat_top, texts
        self.completion_lp = CompletionLogprobs(texts) if completion_logprobs and texts is not None else None

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def prompt_logprobs(self, first: Delta) -> dict | None:
        """With echo: the prompt's log-probabilities (a completion that asked for them)."""
        if self.completion_lp is None or self.echo is None:
            return None
        try:
            return self.completion_lp.prompt(first, self.echo)
        except ValueError as e:
            raise BadLogprobs(str(e)) from None

    def logprobs(self, delta: Delta) -> dict | None:
        """The log-probabilities of one response's tokens, if the request asked for them. Called
        once per response, in order (a completion's text offsets run on)."""
        try:
            if self.completion_lp is not None:
                return self.completion_lp.output(delta)
            if self.chat_top is not None and self.texts is not None:
                return {"content": chat_content(self.texts, delta, self.chat_top), "refusal": None}
        except ValueError as e:
            raise BadLogprobs(str(e)) from None
        return None

    def whole(self, deltas: list[Delta]) -> dict:
        """The answer of a request whose responses were ``deltas`` (the last one final)."""
        last = deltas[-1]
        finish, text = _finish_reason(last.finish_reason), "".join(d.text for d in deltas)
        counts = usage(last.num_input_tokens, last.num_output_tokens)
        if self.kind == "chat":
            logprobs = None
            if self.chat_top is not None:
                content = [e for d in deltas for e in (self.logprobs(d) or {}).get("content", [])]
                logprobs = {"content": content, "refusal": None}
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
            return {**self._base("chat.completion"), "choices": [choice], "usage": counts}
        pieces = [p for p in [self.prompt_logprobs(deltas[0]), *map(self.logprobs, deltas)] if p is not None]
        joined = CompletionLogprobs.join(pieces) if self.completion_lp is not None else None
        choice = {"index": 0, "text": (self.echo or "") + text, "logprobs": joined, "finish_reason": finish}
        return {**self._base("text_completion"), "choices": [choice], "usage": counts}

    def chunk(
        self, text: str | None, finish: str | None, with_usage_field: bool, role: bool = False, logprobs=None
    ) -> dict:
        if self.kind == "chat":
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            body = {**self._base("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            body = {**self._base("text_completion"), "choices": [choice]}
        if with_usage_field:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def build_app(config: FrontendConfig, *, triton_stream: TritonStream | None = None, tokenizer_obj=None) -> FastAPI:
    """The app; ``triton_stream`` and ``tokenizer_obj`` replace the ones it would make from
    ``config`` (unit tests give fakes)."""
    state: dict = {}
    if triton_stream is not None:
        state["triton"] = triton_stream
    if tokenizer_obj is not None:
        state["tokenizer"] = tokenizer_obj
    tracer = start_tracing(config.otlp_endpoint, "openai", config.instance)
    fleet = None
    if config.discovery:
        router = Router(config.router)
        fleet = DecodeFleet(config.discovery, config.deployment, config.secret, router)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if config.tokenizer and "tokenizer" not in state:
            tokenizer()  # loaded before the first chat request, not during it
        if fleet is not None:
            await fleet.start()
        yield
        if fleet is not None:
            await fleet.close()
        if "triton" in state:
            await state["triton"].close()
        tracer.close()

    app = FastAPI(title="triton-disagg OpenAI-compatible API", lifespan=lifespan)

    def triton() -> TritonStream:
        if "triton" not in state:  # made inside the server's event loop
            state["triton"] = TritonStream(config.triton_url)
        return state["triton"]

    def tokenizer(param: str = "messages", what: str = "chat completions need"):
        if "tokenizer" not in state:
            from transformers import AutoTokenizer

            if not config.tokenizer:
                raise UnsupportedField(param, f"{what} the model's tokenizer: this frontend has none (--tokenizer DIR)")
            state["tokenizer"] = AutoTokenizer.from_pretrained(config.tokenizer)
        return state["tokenizer"]

    def token_texts(param: str) -> TokenTexts:
        if "texts" not in state:
            state["texts"] = TokenTexts(tokenizer(param, f"{param} needs"))
        return state["texts"]

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return _error(400, message, "invalid_request_error", ".".join(loc) or None)

    @app.get("/health")
    async def health() -> JSONResponse:
        if fleet is not None:
            if fleet.router.serving():
                return JSONResponse({"status": "ok"})
            why = f"no decode instance of deployment {config.deployment!r} is serving ({fleet.router.down_reasons()})"
            return _error(503, why, "service_unavailable")
        if await triton().ready(config.triton_model):
            return JSONResponse({"status": "ok"})
        return _error(503, f"model {config.triton_model!r} is not ready in Triton", "service_unavailable")

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(exposition(fleet.router if fleet is not None else None), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": config.served_model_name, "object": "model", "created": 0, "owned_by": "triton-disagg"}
        return JSONResponse({"object": "list", "data": [card]})

    def _check_model(name: str) -> JSONResponse | None:
        if name in (config.served_model_name, config.triton_model):
            return None
        return _error(
            404, f"The model '{name}' does not exist (served: {config.served_model_name})", "not_found_error", "model"
        )

    def _params(body, max_tokens: int) -> GenerationParams:
        return GenerationParams(
            max_tokens=max_tokens,
            temperature=OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=list(body.stop or []),
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            guided_json=body.guided_json(),
            cache_salt=body.cache_salt or "",
        )

    async def _run(
        request: Request,
        answer: _Answer,
        prompt: str | list[int],
        params: GenerationParams,
        stream: bool,
        include_usage: bool,
    ):
        operation = "chat" if answer.kind == "chat" else "text_completion"
        span = tracer.span(
            f"{operation} {answer.model}",
            request.headers.get(TRACE_HEADER, ""),
            {
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": answer.model,
                "gen_ai.request.max_tokens": params.max_tokens,
                "triton_disagg.request_id": answer.id,
            },
        )
        if fleet is not None:
            if not isinstance(prompt, str):
                ids = list(prompt)
            elif "tokenizer" in state or config.tokenizer:
                ids = prompt_token_ids(tokenizer(), prompt, False)  # as sent: text_input
            else:
                ids = []
            span.set({"gen_ai.usage.input_tokens": len(ids)})
            deltas = traced(fleet.generate(answer.id, prompt, params, ids, span), span)
        else:
            one = triton().generate(config.triton_model, prompt, params, traceparent=span.traceparent())
            deltas = traced(one, span)
        try:
            first = await _first_or_disconnect(request, deltas)
        except GenerationError as exc:
            log.info("request %s refused: %s", answer.id, exc.message)
            return _generation_error(exc)
        if first is None:  # the client went away before the first token
            return JSONResponse({}, status_code=499)
        if stream:
            return StreamingResponse(
                _events(answer, first, deltas, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await _whole(request, answer, first, deltas)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        try:
            body.check_supported()
            prompt = body.prompt_input()
            params = _params(body, body.output_limit())
            want_logprobs = body.logprobs is not None
            texts = token_texts("logprobs" if want_logprobs else "echo") if want_logprobs or body.echo else None
            params.log_probs = want_logprobs and params.max_tokens > 0
            # max_tokens 0 (echo only): the request scores its prompt, which Triton then needs asked
            params.prompt_log_probs = body.echo and (want_logprobs or params.max_tokens == 0)
            params.num_top_log_probs = body.logprobs or 0
            echo = None
            if body.echo:
                echo = prompt if isinstance(prompt, str) else tokenizer().decode(prompt, skip_special_tokens=False)
        except UnsupportedField as exc:
            return _error(400, str(exc), "invalid_request_error", exc.param)
        if (missing := _check_model(body.model)) is not None:
            return missing
        answer = _Answer("text", body.model, echo=echo, completion_logprobs=want_logprobs, texts=texts)
        return await _run(request, answer, prompt, params, body.stream, body.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        try:
            body.check_supported()
            params = _params(body, body.output_limit() or config.max_tokens_default)
            texts, chat_top = None, None
            if body.logprobs:
                texts, chat_top = token_texts("logprobs"), body.top_logprobs or 0
                params.log_probs, params.num_top_log_probs = True, chat_top
            prompt = tokenizer().apply_chat_template(
                body.template_messages(), add_generation_prompt=True, tokenize=False
            )
        except UnsupportedField as exc:
            return _error(400, str(exc), "invalid_request_error", exc.param)
        if (missing := _check_model(body.model)) is not None:
            return missing
        answer = _Answer("chat", body.model, chat_top=chat_top, texts=texts)
        return await _run(request, answer, prompt, params, body.stream, body.include_usage)

    return app


async def traced(deltas: AsyncGenerator[Delta, None], span: Span) -> AsyncGenerator[Delta, None]:
    """``deltas`` as they come; ``span`` (the request's) ends with them: with the output's token
    count and finish reason, the error that ended them, or the client gone (closing this closes
    ``deltas``, which cancels the call)."""
    n_output, reason = 0, None
    error: str | None = "the client went away"
    try:
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                n_output += len(delta.token_ids)
                reason = delta.finish_reason or reason
                if reason is not None:
                    error = None
                yield delta
    except GenerationError as exc:
        error = f"{exc.kind}: {exc.message}"
        raise
    finally:
        span.set({"gen_ai.usage.output_tokens": n_output, "gen_ai.response.finish_reasons": [reason or ""]})
        span.end(error=error)


async def _cancel(task: asyncio.Future, deltas: AsyncGenerator[Delta, None]) -> None:
    """Stop waiting on Triton: the generation's iterator closes, which cancels its gRPC call."""
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    await deltas.aclose()


async def _first_or_disconnect(request: Request, deltas: AsyncGenerator[Delta, None]) -> Delta | None:
    """The first response, or None (request cancelled in Triton) if the client leaves first."""
    first = asyncio.ensure_future(deltas.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({first}, timeout=0.25)
            if done:
                return first.result()
            if await request.is_disconnected():
                await _cancel(first, deltas)
                return None
    except StopAsyncIteration:
        raise GenerationError(ErrorKind.INTERNAL, "Triton sent no response") from None
    except asyncio.CancelledError:
        await _cancel(first, deltas)
        raise


async def _whole(request: Request, answer: _Answer, first: Delta, deltas: AsyncGenerator[Delta, None]):
    """A non-streamed answer; a client that disconnects meanwhile cancels the request."""
    got = [first]

    async def collect():
        async for d in deltas:
            got.append(d)

    if first.finish_reason is None:
        task = asyncio.ensure_future(collect())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and await request.is_disconnected():
                    await _cancel(task, deltas)
                    log.info("request %s: client disconnected; cancelled", answer.id)
                    return JSONResponse({}, status_code=499)
            task.result()
        except GenerationError as exc:
            return _generation_error(exc)
        except asyncio.CancelledError:
            await _cancel(task, deltas)
            raise
        finally:
            await deltas.aclose()
    try:
        return JSONResponse(answer.whole(got))
    except GenerationError as exc:
        log.error("request %s: %s", answer.id, exc.message)
        return _generation_error(exc)


async def _events(answer: _Answer, first: Delta, deltas: AsyncGenerator[Delta, None], include_usage: bool):
    """Server-sent events; if the client disconnects, Starlette cancels this generator and
    closing ``deltas`` cancels the Triton request."""
    last = first
    try:
        if answer.kind == "chat":
            yield _sse(answer.chunk(None, None, include_usage, role=True))
        if answer.echo is not None:
            yield _sse(answer.chunk(answer.echo, None, include_usage, logprobs=answer.prompt_logprobs(first)))
        d = first
        while True:
            last = d
            logprobs = answer.logprobs(d)
            if d.text or (logprobs is not None and d.token_ids):  # tokens without text yet: their logprobs
                yield _sse(answer.chunk(d.text, None, include_usage, logprobs=logprobs))
            if d.finish_reason is not None:
                yield _sse(
                    answer.chunk(None if answer.kind == "chat" else "", _finish_reason(d.finish_reason), include_usage)
                )
                break
            try:
                d = await deltas.__anext__()
            except StopAsyncIteration:
                break
        if include_usage:
            yield _sse(answer.usage_chunk(last.num_input_tokens, last.num_output_tokens))
        yield "data: [DONE]\n\n"
    except GenerationError as exc:
        status, type_ = _STATUS.get(exc.kind, (500, "server_error"))
        log.info("request %s failed after its first token: %s", answer.id, exc.message)
        yield _sse(error_body(exc.message, type_, code=str(status)))
        yield "data: [DONE]\n\n"
    finally:
        await deltas.aclose()
