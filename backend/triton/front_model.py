"""Triton Python-backend front model of the disaggregated deployment.

Clients call it with the same tensors as the aggregated ``llm`` model. It tokenizes the prompt
as the decode models do and sends each request to one decode target, streaming the responses
back as they arrive. The targets (``backend/triton/decode_targets.py``): every decode instance
of the deployment's membership, on every server, or, with ``decode_models``, a fixed list of
this server's decode models; each by a gRPC stream (``backend/serving/decode_stream.py``),
this server's too: a decode model answering a BLS caller whose stub died blocks for good, while
a gRPC stream whose client is gone is cancelled there. Which one, and where a request goes when
its target fails it, is the shared front core's (``backend/serving/routing.py`` and the move
loop's decisions, ``backend/serving/migration.py``, the same as the OpenAI frontend's): among
the serving ones, the lowest KV-aware routing cost (prompt pages it does not cache, and load).
A response whose ``finish_reason`` is set is the last one. A client that cancels gets its
request cancelled on the target (Triton's request cancellation over gRPC; a control request,
``cancel_request_id``, over BLS), so the decode instance (and the prefill instance working for
it) stop and free their pages; so does a front model whose stub dies.

Request migration: when a target goes down (its readiness probes fail) or leaves the membership,
answers a request as out of service, fails in a way that is not the request's fault (Triton's
error for a dead stub, a broken call to a server that died) or ends its stream early (which
counts as a failed probe of it), the request moves to another serving target, never one that
failed it before, with the output its client already has (``resume_token_ids``); that target
computes or fetches the KV of prompt plus output (its prefix cache, a prefill instance, or
itself) and continues the stream where it stopped: the client sees one stream, no token
repeated or lost (greedy output equals an uninterrupted run; a guided request's grammar replays
the sent tokens; a sampled one goes on with its parameters). A request that a target refuses as
overloaded (no KV pages for it in time) before any output moves too, to a target with room (one
just added, say); with none, the refusal is its answer. At most ``migration_limit`` moves per
request. When the deployment stops (``backend/triton/lifecycle.py``), every request fails
with the drain message.

Tracing (``otlp_endpoint``): a request is a span here (``text_completion <model>``, the child of
the client's ``traceparent``), each attempt on a decode model a child span of it (``route
<target>``) whose context goes to the decode model with the call (the decode and prefill
instances' spans then join it), and each move an event on the request's span.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from backend.cluster.tracing import Span, Tracer, start_tracing
from backend.engine.outputs import ErrorKind
from backend.serving.config import FrontConfig
from backend.serving.migration import Migration, lost_why
from backend.serving.perf_metrics import with_route
from backend.serving.request import parse_request, prompt_token_ids
from backend.serving.routing import FIRST_PICK_POLL_S, REASONS, NotMoved
from backend.serving.tensors import PERF_OUTPUT
from backend.triton.decode_targets import DecodeTargets
from backend.triton.lifecycle import DRAIN_MESSAGE, DrainWatch
from backend.triton.metrics import COUNTERS
from backend.triton.model_args import init_model
from backend.triton.sender import GuardedSender, triton_error
from backend.triton.trace_context import traceparent_of

log = logging.getLogger("triton_disagg.front")
RESUME = "resume_token_ids"


class TritonPythonModel:
    def initialize(self, args):
        self.pb, cfg, params, instance = init_model(args)
        config = FrontConfig.from_parameters(params)
        self.tracer = start_tracing(config.membership.otlp_endpoint, "front", instance)
        self.served_model = Path(config.model_path).name or cfg["name"]
        self.draining = False
        self.config = config
        self.targets = DecodeTargets(self.pb, config, self._fail_lost)
        self.table = self.targets.table
        self.tokenizer = None
        if config.model_path.strip():
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        else:
            log.warning("front model %s: no model_path, so no tokenizer: routing by load alone", cfg["name"])
        self.metrics = FrontMetrics(self.pb, cfg["name"], self.targets, self.tracer)
        self.drain = DrainWatch(args["model_repository"], self._drain)
        self.targets.start()
        log.info("front model %s: routing to %s", cfg["name"], config.targets())

    def execute(self, requests):
        pb = self.pb
        for request in requests:
            sender = GuardedSender(pb, request.get_response_sender())
            arrays = {t.name(): t.as_numpy() for t in request.inputs()}
            prompt_ids, pages, cache_salt = self._route_key(arrays)
            span = self.tracer.span(
                f"text_completion {self.served_model}",
                traceparent_of(request),
                {
                    "gen_ai.operation.name": "text_completion",
                    "gen_ai.request.model": self.served_model,
                    "gen_ai.usage.input_tokens": len(prompt_ids),
                },
            )
            fwd = Forwarding(
                f"front-{uuid.uuid4().hex}",
                prompt_ids,
                pages,
                sent=_resume_ids(arrays),
                cache_salt=cache_salt,
                sender=sender,
                inputs={name: arr for name, arr in arrays.items() if name != RESUME},
                span=span,
            )
            span.set({"triton_disagg.request_id": fwd.request_id})
            if not self._begin(fwd, 0.0):
                threading.Thread(target=self._begin_when_served, args=(fwd,), daemon=True).start()
        return None

    def _begin(self, fwd: "Forwarding", waited_s: float) -> bool:
        """Send ``fwd`` to its first target, or answer it with why it cannot go anywhere; False
        while it waits for a target's first passing probe (a server starting)."""
        try:
            if self.draining:
                raise NotMoved(DRAIN_MESSAGE)
            target = fwd.first(self.table, waited_s)
        except NotMoved as e:
            _send_error(self.pb, fwd, e.kind, e.message)
            return True
        if target is None:
            return False
        with fwd.lock:
            self._start(fwd, target)
        return True

    def _begin_when_served(self, fwd: "Forwarding") -> None:
        """No decode model serves yet, but one has not passed a probe (the server starts): wait
        for it, at most ``health_probe_timeout_s``."""
        t0 = time.monotonic()
        while not self._begin(fwd, time.monotonic() - t0):
            time.sleep(FIRST_PICK_POLL_S)

    def _route_key(self, arrays: dict) -> tuple[list[int], int, str]:
        """The prompt's token ids (empty when there is no tokenizer, or the request is malformed
        or over the default input limit: the decode model refuses it with the reason, or gets it
        routed by load), the pages it will hold and its ``cache_salt``."""
        try:
            req = parse_request(arrays.get, max_tokens_limit=1 << 30)
            if req.input_ids is not None:
                ids = list(req.input_ids)
            else:
                ids = (
                    []
                    if self.tokenizer is None
                    else prompt_token_ids(self.tokenizer, req.text, req.apply_chat_template)
                )
        except Exception as e:  # RequestError, or a text the tokenizer rejects: the decode model says why
            log.debug("routing a request by load alone: %s", e)
            return [], 1, ""
        return ids, self.table.pages(len(ids) + req.max_tokens), req.cache_salt

    def _start(self, fwd: "Forwarding", target: str) -> None:
        """Forward ``fwd`` to ``target`` as a new attempt (the caller holds ``fwd.lock``); the
        output already sent goes along as ``resume_token_ids``."""
        inputs = dict(fwd.inputs)
        if fwd.sent:
            inputs[RESUME] = np.array(fwd.sent, dtype=np.int32)
        span = fwd.begin(target)
        threading.Thread(target=self._forward, args=(fwd, target, fwd.attempt, inputs, span), daemon=True).start()

    def _relayed(self, fwd: "Forwarding", outputs: dict) -> list:
        """A decode model's response as the client gets it across moves: the prompt's
        log-probabilities go once (a later attempt is not asked for them again), and
        ``cum_log_probs`` counts the output of earlier attempts too."""
        out = []
        for name, arr in outputs.items():
            if name == "prompt_log_probs":
                fwd.inputs.pop("return_prompt_log_probs", None)
                if not fwd.relay_prompt():
                    continue  # an earlier attempt sent them
            elif name == "cum_log_probs":
                arr = np.array([fwd.cumulative(float(arr.reshape(-1)[0]))], dtype=np.float32)
            elif name == PERF_OUTPUT:  # the decode instance's figures, and the front's across attempts
                ttft = (fwd.t_first or time.perf_counter()) - fwd.t_start
                figures = with_route(arr.reshape(-1)[0], migrations=fwd.moves, attempts=fwd.attempt, front_ttft_s=ttft)
                arr = np.array([figures.encode()], dtype=object)
            out.append(self.pb.Tensor(name, arr))
        return out

    def _move(self, fwd: "Forwarding", attempt: int, target: str, why: str, reason: str) -> None:
        """Attempt ``attempt`` of ``fwd`` on ``target`` ended without finishing the request: the
        routing core moves it (the prompt plus the tokens its client has) to another serving
        decode model, or it fails, saying why."""
        with fwd.lock:
            if fwd.attempt != attempt or fwd.target != target or fwd.sender.closed:
                return  # moved or answered already
            if fwd.sender.is_cancelled():
                return
            try:
                if self.draining:
                    fwd.attempt_span.end(error=why)
                    raise NotMoved(DRAIN_MESSAGE)
                retry = fwd.moved(self.table, target, why, reason)
            except NotMoved as e:
                fwd.attempt += 1  # no relay of the old attempt may follow the error
                _send_error(self.pb, fwd, e.kind, e.message)
                return
            self._start(fwd, retry)

    def _fail_lost(self, target: str, reason: str, lost: list) -> None:
        """``target`` went down: its requests move to another decode model (a dead instance
        would never finish them)."""
        for fwd in lost:
            with fwd.lock:
                attempt = fwd.attempt
            self._move(fwd, attempt, target, lost_why(reason), "instance_down")

    def _drain(self) -> None:
        """The server stops: no new requests; those in flight go on until their decode models
        end them (they drain too) or the front unloads."""
        self.draining = True
        self.targets.close()  # no more probes: the decode models drain too
        log.warning("front model: the server stops; %d request(s) in flight may finish", len(self.table.in_flight()))

    def _forward(self, fwd: "Forwarding", target: str, attempt: int, inputs: dict, span: Span) -> None:
        ended = self._forward_once(fwd, target, attempt, inputs, span.traceparent())
        self.table.done(target, fwd)
        span.end(error=ended[0] if ended is not None else None)
        if fwd.sender.is_cancelled():
            fwd.span.end(error="cancelled by the client")
        if ended is not None:
            why, reason = ended
            if reason == "stream_error":
                self.targets.failed(target, why)  # counts as a failed probe of it
            self._move(fwd, attempt, target, why, reason)

    def _forward_once(self, fwd: "Forwarding", target: str, attempt: int, inputs: dict, traceparent: str):
        """Relay one attempt. Returns why the target stopped serving the request before its end
        (its out-of-service error, an error that is not ours, e.g. Triton's for a dead stub or
        a broken call to a dead server, a stream that ended without a final response, or an
        overloaded refusal before any output) and the move's reason; the caller moves it
        elsewhere. None when it is answered or failed for good."""
        link = self.targets.link(target)
        if link is None:
            return "it left the membership", "stream_error"
        call = link.open(f"{fwd.request_id}-{attempt}", inputs, traceparent)
        stop = threading.Event()
        # the first response may take long (a prefill): the watcher must run already
        threading.Thread(target=self._watch, args=(fwd, attempt, target, call, stop), daemon=True).start()
        try:
            return self._relay(fwd, attempt, target, call.replies())
        except Exception as e:
            log.warning("forwarding to %s failed: %s", target, e)
            return f"{type(e).__name__}: {e}", "stream_error"
        finally:
            stop.set()
            call.finish()

    def _relay(self, fwd: "Forwarding", attempt: int, target: str, replies):
        pb = self.pb
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        sender = fwd.sender
        for reply in replies:
            with fwd.lock:
                if fwd.attempt != attempt or sender.closed:  # superseded, or failed here already
                    return None
                if sender.is_cancelled():
                    return None
                if reply.error is not None:
                    moves, kind, message = fwd.outcome(reply.error)
                    if moves is not None:  # a dead stub or server, or ours (draining, overloaded, ...)
                        return message, moves
                    assert kind is not None  # an error without a kind moves
                    _send_error(pb, fwd, kind, message)
                    return None
                self.targets.heard(target)
                if not reply.outputs:
                    continue
                reason = reply.outputs.get("finish_reason")
                last = reason is not None and reason.reshape(-1)[0] not in (b"", "")
                sender.send(
                    pb.InferenceResponse(output_tensors=self._relayed(fwd, reply.outputs)), flags=final if last else 0
                )
                ids = reply.outputs.get("output_token_ids")
                if ids is not None:
                    if fwd.t_first is None and ids.size:
                        fwd.t_first = time.perf_counter()
                    fwd.sent.extend(int(t) for t in ids.reshape(-1))
                if last:
                    assert reason is not None
                    fwd.span.set(
                        {
                            "gen_ai.usage.output_tokens": len(fwd.sent),
                            "gen_ai.response.finish_reasons": [str(_text(reason.reshape(-1)[0]))],
                            "triton_disagg.attempts": attempt,
                        }
                    )
                    fwd.span.end()
                    return None
        with fwd.lock:
            if fwd.attempt != attempt or sender.closed or sender.is_cancelled():
                return None
        return "its stream ended before the request finished", "stream_error"

    def _watch(self, fwd: "Forwarding", attempt: int, target: str, call, stop: threading.Event) -> None:
        """When the client cancels, cancel this attempt there at once, even before any token
        (e.g. while its prefill runs), so that both sides free their pages. An attempt on another
        server is cancelled too when the request moved elsewhere meanwhile (its target went down:
        closing our own gRPC stream is safe); one on this server is not (a BLS call into a model
        that died and is being reloaded is what that would be)."""
        remote = not call.local
        while not stop.wait(0.05):
            cancelled, moved = fwd.sender.is_cancelled(), fwd.attempt != attempt
            if cancelled or (moved and remote):
                why = "the client cancelled" if cancelled else "it moved elsewhere"
                log.info("%s attempt %d: %s; cancelling it on %s", fwd.request_id, attempt, why, target)
                call.cancel()
                return
            if moved:
                return

    def finalize(self):
        self.draining = True
        self.drain.close()
        self.targets.close()
        for fwd in self.table.in_flight():
            assert isinstance(fwd, Forwarding)
            _send_error(self.pb, fwd, ErrorKind.OUT_OF_SERVICE, DRAIN_MESSAGE)
        self.metrics.close()
        self.tracer.close()


@dataclass(eq=False, kw_only=True)
class Forwarding(Migration):
    """One client request on its way through the front (a :class:`Migration`: the shared move
    loop's state). Its ``attempt`` owns the client's sender (a newer one supersedes an attempt on
    a decode model that stopped serving it); ``lock`` guards the sender and the attempt."""

    sender: GuardedSender
    inputs: dict  # the client's tensors (name -> array), without resume_token_ids
    lock: threading.Lock = field(default_factory=threading.Lock)
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float | None = None  # when its first output token was relayed


def _resume_ids(arrays: dict) -> list[int]:
    """Output a client says it has already (``resume_token_ids``; checked by the decode model)."""
    arr = arrays.get(RESUME)
    try:
        return [] if arr is None else [int(v) for v in np.asarray(arr).reshape(-1)]
    except (TypeError, ValueError):
        return []


def _send_error(pb, fwd: Forwarding, kind: ErrorKind, message: str) -> None:
    """Answer ``fwd`` with an error (its last response); its span ends with it."""
    fwd.span.end(error=f"{kind}: {message}")
    try:
        fwd.sender.send(
            pb.InferenceResponse(error=triton_error(pb, kind, message)), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )
    except Exception:
        pass  # the final response went already


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class FrontMetrics:
    """``triton_disagg_decode_target_up{model, target, grpc_url}``: 1 while the front routes to
    decode model ``target`` at ``grpc_url`` ("" for its own server's);
    ``triton_disagg_requests_active{model}``: requests the front is relaying;
    ``triton_disagg_router_query_tokens_total`` / ``_router_predicted_hit_tokens_total``: prompt
    tokens routed, and how many of them the chosen decode model was judged to cache;
    ``triton_disagg_migrations_total{model, reason}``: requests moved to another decode model
    (``instance_down``: its probes failed or it left; ``stream_error``: its stream failed or stopped);
    ``triton_disagg_trace_spans_dropped_total{model}``: its trace spans not exported."""

    def __init__(self, pb, model: str, targets: DecodeTargets, tracer: Tracer, period_s: float = 0.25):
        self._targets = targets
        self._tracer = tracer
        self._dropped_family = pb.MetricFamily(
            name="triton_disagg_trace_spans_dropped_total",
            description=COUNTERS["trace_spans_dropped_total"],
            kind=pb.MetricFamily.COUNTER,
        )
        self._dropped = self._dropped_family.Metric(labels={"model": model, "instance": model})
        self._dropped_seen = 0
        self._migrations = targets.table.migrations
        self._migration_family = pb.MetricFamily(
            name="triton_disagg_migrations_total",
            description="requests the front moved to another decode model, by reason",
            kind=pb.MetricFamily.COUNTER,
        )
        self._migrated = {r: self._migration_family.Metric(labels={"model": model, "reason": r}) for r in REASONS}
        self._migrated_seen = dict.fromkeys(REASONS, 0)
        self._up_family = pb.MetricFamily(
            name="triton_disagg_decode_target_up",
            description="1 while the front model routes to this decode model (ready, and its record says it serves)",
            kind=pb.MetricFamily.GAUGE,
        )
        self._active_family = pb.MetricFamily(
            name="triton_disagg_requests_active",
            description="requests admitted and not finished in this instance",
            kind=pb.MetricFamily.GAUGE,
        )
        self._model = model
        self._up: dict = {}  # (decode model, grpc_url) -> its gauge
        self._active = self._active_family.Metric(labels={"model": model, "instance": model})
        self._router_families = [
            pb.MetricFamily(name=f"triton_disagg_router_{name}_total", description=text, kind=pb.MetricFamily.COUNTER)
            for name, text in (
                ("query_tokens", "prompt tokens the KV-aware router routed"),
                ("predicted_hit_tokens", "prompt tokens routed to a decode model judged to cache them"),
            )
        ]  # referenced: a family must outlive its metrics
        self._router = {
            name: fam.Metric(labels={"model": model})
            for name, fam in zip(("query_tokens", "predicted_hit_tokens"), self._router_families)
        }
        self._router_seen = dict.fromkeys(self._router, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, args=(period_s,), name="front-metrics", daemon=True)
        self._thread.start()

    def _refresh(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            gauges = self._targets.gauges()
            for key in gauges.keys() - self._up.keys():
                model, url = key
                self._up[key] = self._up_family.Metric(labels={"model": self._model, "target": model, "grpc_url": url})
            for key, metric in self._up.items():
                metric.set(gauges.get(key, 0.0))  # none there now (left, or a server down): 0
            self._active.set(float(len(self._targets.table.in_flight())))
            counters = dict(self._targets.table.kv.counters)
            for name, metric in self._router.items():
                metric.increment(counters[name] - self._router_seen[name])
                self._router_seen[name] = counters[name]
            for reason, metric in self._migrated.items():
                n = self._migrations[reason]
                metric.increment(n - self._migrated_seen[reason])
                self._migrated_seen[reason] = n
            dropped = self._tracer.stats()["spans_dropped"]
            self._dropped.increment(dropped - self._dropped_seen)
            self._dropped_seen = dropped

    def close(self) -> None:
        """Stop refreshing and release every metric and family now, while the stub's shared
        memory is there: one left to the interpreter's exit is destroyed as it collects garbage,
        and its destructor writes to the shared memory already gone (the stub died with
        "Segmentation fault ... Garbage-collecting" at every shutdown)."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._up.clear()
        self._migrated.clear()
        self._router.clear()
        self._dropped = self._active = None
        self._dropped_family = self._migration_family = self._up_family = self._active_family = None
        self._router_families = []
