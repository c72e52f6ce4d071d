"""Admission of client requests into one instance's worker, independent of Triton: parse and
validate the tensors, compile a grammar (on a worker thread, with size and time limits),
tokenize, enforce the in-flight limit, open a
:class:`GenerationSession` and hand it to the worker; cancel by the caller's request id; tell
the owner (metrics) when a session ends. The Triton model (``backend/triton/llm_model.py``)
only adapts its tensors and response sender to this. With tracing on (``otlp_endpoint``) each
request gets a span here (``decode`` or ``generate``), the child of the caller's ``traceparent``;
it ends with the request, or with its refusal."""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from backend.cluster.tracing import Span, start_tracing
from backend.engine.outputs import ErrorKind
from backend.engine.sampling.grammar import GrammarCompiler, GrammarError
from backend.serving.config import InstanceConfig
from backend.serving.detokenizer import IncrementalDetokenizer
from backend.serving.request import Getter, RequestError, parse_request, prompt_token_ids
from backend.serving.session import GenerationSession, ResponseSink
from backend.serving.worker import Worker

log = logging.getLogger("triton_disagg.admission")


class Admission:
    def __init__(
        self,
        config: InstanceConfig,
        worker: Worker,
        tokenizer,
        name: str,
        on_done: Callable[[GenerationSession, str], None] | None = None,
    ):
        self.config, self.worker, self.tokenizer, self.name = config, worker, tokenizer, name
        self.max_tokens_limit = config.engine.max_tokens_limit
        self.max_in_flight = config.serving.max_queue_size
        self._on_done_hook = on_done
        self.sessions: dict[str, GenerationSession] = {}
        self.by_external_id: dict[str, str] = {}  # the caller's (Triton) request id -> ours
        self._grammar_compiler: GrammarCompiler | None = None
        self._compile_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-grammar")
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._tag = uuid.uuid4().hex[:6]  # request ids stay unique across servers and restarts
        self._draining: str | None = None  # set once: why new requests are refused
        self._drain_kind = ErrorKind.OUT_OF_SERVICE  # DRAINING while in-flight requests may finish
        self.tracer = start_tracing(config.membership.otlp_endpoint, config.role, name)
        self._span_name = "generate" if config.role == "aggregated" else config.role
        self._model = Path(config.engine.model_path).name

    def admit(self, get: Getter, sink: ResponseSink, external_id: str = "", traceparent: str = "") -> None:
        """Start one request; every failure is answered through ``sink`` with its kind. A request
        with a grammar returns at once: its grammar compiles on a worker thread and the rest of
        the admission runs when it is ready (:meth:`_admit_guided`). ``traceparent``: the
        caller's trace context (W3C; "" : none)."""
        span = self.tracer.span(
            self._span_name,
            traceparent,
            {"gen_ai.operation.name": "text_completion", "gen_ai.request.model": self._model},
        )
        try:
            req = parse_request(
                get, max_tokens_limit=self.max_tokens_limit, max_input_bytes=self.config.serving.max_input_bytes
            )
            span.set({"gen_ai.request.max_tokens": req.max_tokens, "triton_disagg.resumed_tokens": len(req.resume_ids)})
            if req.guided_json is not None or req.guided_regex is not None:
                self._admit_guided(req, sink, external_id, span)
            else:
                self._start(req, sink, external_id, span)
        except RequestError as e:
            self._refuse(sink, e, span)
        except Exception as e:  # never let one request take the instance down
            log.exception("failed to admit request")
            sink.error(f"internal error: {e}", ErrorKind.INTERNAL)
            span.end(error=f"internal error: {e}")

    def _start(self, req, sink: ResponseSink, external_id: str, span: Span) -> None:
        """Tokenize, take an in-flight slot, open the session, hand it to the worker."""
        prompt_ids = self._tokenize(req)
        with self._lock:
            if self._draining is not None:
                raise RequestError(self._draining, self._drain_kind)
            if len(self.sessions) >= self.max_in_flight:
                raise RequestError(
                    f"{len(self.sessions)} requests in flight (max_queue_size {self.max_in_flight}); retry later",
                    ErrorKind.OVERLOADED,
                )
            req_id = f"{self.name}-{self._tag}-{next(self._ids)}"
            detok = IncrementalDetokenizer(self.tokenizer, req.stop_words)
            detok.add(req.resume_ids)  # sent before (migration): only what follows is new text
            session = GenerationSession(
                req_id,
                req,
                prompt_ids + req.resume_ids,
                sink,
                detok,
                cancel_engine=self.worker.cancel,
                on_done=self._on_done,
                resumed=len(req.resume_ids),
                span=span,
            )
            span.set({"triton_disagg.request_id": req_id})
            session.triton_id = external_id
            self.sessions[req_id] = session
            if external_id:
                self.by_external_id[external_id] = req_id
        ended = req.resumed_end(self.worker.end_ids)
        if ended is not None:  # nothing left to generate: its final response, no new token
            log.info("request %s: its resumed output is complete (%s); ending it", req_id, ended)
            session.on_output([], True, ended)
            return
        self.worker.submit(session)

    @staticmethod
    def _refuse(sink: ResponseSink, e: RequestError, span: Span) -> None:
        log.info("refused request: %s", e)
        sink.error(str(e), e.kind)
        span.end(error=f"{e.kind}: {e}")

    def _admit_guided(self, req, sink: ResponseSink, external_id: str, span: Span) -> None:
        """Compile the grammar on the compile thread; whichever comes first, the compiled grammar
        or ``max_grammar_compile_s``, decides the request (a late grammar still lands in the
        cache, so a retry of the same schema is fast)."""
        serving = self.config.serving
        name = "guided_json" if req.guided_json is not None else "guided_regex"
        size = len((req.guided_json or req.guided_regex).encode())
        if size > serving.max_grammar_bytes:
            raise RequestError(
                f"'{name}' has {size} bytes; the limit is {serving.max_grammar_bytes} (max_grammar_bytes)"
            )
        compiler = self._compiler()
        decided = threading.Event()
        limit = serving.max_grammar_compile_s

        def first() -> bool:
            with self._lock:
                if decided.is_set():
                    return False
                decided.set()
                return True

        def too_slow() -> None:
            if first():
                why = f"'{name}' did not compile within {limit:g} s (max_grammar_compile_s)"
                self._refuse(sink, RequestError(why), span)

        def compiled(future) -> None:
            timer.cancel()
            if not first():
                return
            try:
                req.grammar = future.result()
                if sink.is_cancelled():
                    log.info("a guided request was cancelled while its grammar compiled")
                    sink.close()  # its final flag: Triton lets go of the request's response factory
                    span.end(error="cancelled by the client")
                else:
                    self._start(req, sink, external_id, span)
            except GrammarError as e:
                self._refuse(sink, RequestError(str(e)), span)
            except RequestError as e:
                self._refuse(sink, e, span)
            except Exception as e:
                log.exception("failed to admit a guided request")
                sink.error(f"internal error: {e}", ErrorKind.INTERNAL)
                span.end(error=f"internal error: {e}")

        timer = threading.Timer(limit, too_slow)
        timer.daemon = True
        timer.start()
        self._compile_pool.submit(compiler.compile, req.guided_json, req.guided_regex).add_done_callback(compiled)

    def _compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.worker.vocab_size, self.config.serving.grammar_cache_bytes
                )
            return self._grammar_compiler

    def close(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self.tracer.close()

    @property
    def draining(self) -> str | None:
        """Why new requests are refused (None: they are not)."""
        return self._draining

    def drain_gracefully(self, reason: str, timeout_s: float) -> threading.Thread | None:
        """Take this instance out without failing a request: refuse new requests with kind
        ``draining`` (routers send them elsewhere), mark it draining in the membership, let the
        requests in flight finish for up to ``timeout_s``, then end the rest as out of service
        (routers move them, with the output already sent) and leave the membership. Runs on a
        thread of its own (returned; None if a drain began already)."""
        with self._lock:
            if self._draining is not None:
                return None
            self._draining, self._drain_kind = reason, ErrorKind.DRAINING
        self.worker.leave(final=False)
        log.warning("%s: draining (%s): no new requests; %d in flight may finish", self.name, reason, self.active())

        def finish() -> None:
            deadline = time.monotonic() + timeout_s
            while self.active() and time.monotonic() < deadline:
                time.sleep(0.1)
            with self._lock:
                sessions = list(self.sessions.values())
            for session in sessions:
                session.fail(
                    f"{reason}; not finished within drain_timeout_s ({timeout_s:g} s)", ErrorKind.OUT_OF_SERVICE
                )
                session.cancelled = True
                self.worker.cancel(session.req_id)
            self.worker.leave(final=True)
            log.warning(
                "%s: drained (%s): %d request(s) ended unfinished; left the membership",
                self.name,
                reason,
                len(sessions),
            )

        thread = threading.Thread(target=finish, name=f"{self.name}-drain", daemon=True)
        thread.start()
        return thread

    def drain(self, reason: str) -> int:
        """Refuse every new request with ``reason`` and end every one in flight with it (their
        work stops as for a client cancel, so their pages come back). Returns how many ended."""
        with self._lock:
            self._draining, self._drain_kind = reason, ErrorKind.OUT_OF_SERVICE
            sessions = list(self.sessions.values())
        self.worker.leave(final=False)  # routers send it nothing new
        for session in sessions:
            session.cancelled = True
            self.worker.cancel(session.req_id)
            session.fail(reason, ErrorKind.OUT_OF_SERVICE)
        log.info("%s: draining (%s); ended %d request(s) in flight", self.name, reason, len(sessions))
        return len(sessions)

    def cancel_by_external_id(self, external_id: str) -> None:
        with self._lock:
            session = self.sessions.get(self.by_external_id.get(external_id, ""))
        if session is None:
            return
        log.info("request %s (%s) cancelled by its sender", session.req_id, external_id)
        session.cancelled = True
        self.worker.cancel(session.req_id)

    def active(self) -> int:
        with self._lock:
            return len(self.sessions)

    def _tokenize(self, req) -> list[int]:
        if req.input_ids is not None:
            ids = list(req.input_ids)
            if max(ids) >= self.worker.vocab_size:
                raise RequestError(f"'input_ids' holds a token outside the vocabulary of {self.worker.vocab_size}")
        else:
            ids = prompt_token_ids(self.tokenizer, req.text, req.apply_chat_template)
        if not ids:
            raise RequestError("'text_input' tokenizes to nothing")
        max_model_len = self.worker.max_model_len
        if len(ids) + max(1, req.max_tokens) > max_model_len:  # a scoring request (0) runs one step
            raise RequestError(
                f"prompt of {len(ids)} tokens plus max_tokens {req.max_tokens} exceeds "
                f"the model context of {max_model_len} tokens"
            )
        if any(t >= self.worker.vocab_size for t in req.resume_ids):
            raise RequestError(f"'resume_token_ids' holds a token outside the vocabulary of {self.worker.vocab_size}")
        if req.end_id is None:
            req.end_id = self.tokenizer.eos_token_id
        elif not 0 <= req.end_id < self.worker.vocab_size:
            raise RequestError(f"'end_id' {req.end_id} is outside the vocabulary of {self.worker.vocab_size} tokens")
        return ids

    def _on_done(self, session: GenerationSession, reason: str) -> None:
        with self._lock:
            self.sessions.pop(session.req_id, None)
            self.by_external_id.pop(session.triton_id, None)
        if self._on_done_hook is not None:
            self._on_done_hook(session, reason)
