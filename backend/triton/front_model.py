"""Triton Python-backend front model of the disaggregated deployment.

Clients call it with the same tensors as the aggregated ``llm`` model. It tokenizes the prompt
as the decode models do and sends each request to one decode model (among the serving ones, by
the health state of ``backend/triton/decode_targets.py``, the one with the lowest KV-aware
routing cost: prompt pages it does not cache, and load; the decode models are listed in the
``decode_models`` parameter) with a decoupled BLS call and streams the responses back as they arrive. A
response whose ``finish_reason`` is set is the last one. A client that cancels gets its
request cancelled on the decode model by a control request (``cancel_request_id``), so the
decode instance (and the prefill instance working for it) stop and free their pages. When a
decode model goes down, its requests fail here at once; when the deployment stops
(``backend/triton/lifecycle.py``), every request does.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field

import numpy as np

from backend.engine.outputs import ErrorKind
from backend.serving.config import FrontConfig
from backend.serving.errors import parse_error
from backend.serving.request import parse_request, prompt_token_ids
from backend.serving.tensors import OUTPUTS
from backend.triton.decode_targets import DecodeTargets
from backend.triton.lifecycle import DRAIN_MESSAGE, DrainWatch
from backend.triton.model_args import init_model
from backend.triton.sender import GuardedSender, triton_error

log = logging.getLogger("triton_disagg.front")
MAX_ATTEMPTS = 2  # decode models a request without output is tried on


class TritonPythonModel:
    def initialize(self, args):
        self.pb, cfg, params, _ = init_model(args)
        config = FrontConfig.from_parameters(params)
        self.outputs = [o.name for o in OUTPUTS]
        self.draining = False
        self.targets = DecodeTargets(self.pb, config, self._fail_lost)
        self.tokenizer = None
        if config.model_path.strip():
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        else:
            log.warning("front model %s: no model_path, so no tokenizer: routing by load alone", cfg["name"])
        self.metrics = FrontMetrics(self.pb, cfg["name"], self.targets)
        self.drain = DrainWatch(args["model_repository"], self._drain)
        self.targets.start()
        log.info("front model %s: routing to %s", cfg["name"], config.targets())

    def execute(self, requests):
        pb = self.pb
        for request in requests:
            sender = GuardedSender(pb, request.get_response_sender())
            arrays = {t.name(): t.as_numpy() for t in request.inputs()}
            fwd = Forwarding(sender, [pb.Tensor(name, arr) for name, arr in arrays.items()])
            fwd.token_ids, fwd.pages = self._route_key(arrays)
            target = None if self.draining else self.targets.pick(fwd, fwd.token_ids, fwd.pages)
            if target is None:
                why = DRAIN_MESSAGE if self.draining else f"no decode model is serving ({self.targets.down_reasons()})"
                _send_error(pb, sender, ErrorKind.OUT_OF_SERVICE, why)
                continue
            self._start(fwd, target)
        return None

    def _route_key(self, arrays: dict) -> tuple[list[int], int]:
        """The prompt's token ids (empty when there is no tokenizer, or the request is malformed
        or over the default input limit: the decode model refuses it with the reason, or gets it
        routed by load) and the pages it will hold."""
        try:
            req = parse_request(arrays.get, max_tokens_limit=1 << 30)
            ids = [] if self.tokenizer is None else prompt_token_ids(self.tokenizer, req.text, req.apply_chat_template)
        except Exception as e:  # RequestError, or a text the tokenizer rejects: the decode model says why
            log.debug("routing a request by load alone: %s", e)
            return [], 1
        return ids, -(-(len(ids) + req.max_tokens) // self.targets.page_size())

    def _start(self, fwd: "Forwarding", target: str) -> None:
        with fwd.lock:
            fwd.attempt += 1
            attempt = fwd.attempt
        threading.Thread(target=self._forward, args=(fwd, target, attempt), daemon=True).start()

    def _reroute(self, fwd: "Forwarding", target: str, reason: str) -> None:
        """``target`` did not serve a request that has no output yet: send it to another
        serving decode model (once), else fail it."""
        retry = None
        if not self.draining and fwd.attempt < MAX_ATTEMPTS:
            retry = self.targets.pick(fwd, fwd.token_ids, fwd.pages, exclude=target)
        if retry is None:
            _send_error(self.pb, fwd.sender, ErrorKind.OUT_OF_SERVICE, f"decode model {target}: {reason}")
            return
        log.warning("decode model %s did not serve a request (%s); sending it to %s", target, reason, retry)
        self._start(fwd, retry)

    def _fail_lost(self, target: str, reason: str, lost: list) -> None:
        """``target`` went down: its requests without output yet go elsewhere; the others fail
        now (a dead instance would never finish them)."""
        for fwd in lost:
            if not fwd.relayed:
                self._reroute(fwd, target, f"stopped serving ({reason})")
            else:
                message = f"decode model {target} stopped serving ({reason}); request lost"
                _send_error(self.pb, fwd.sender, ErrorKind.OUT_OF_SERVICE, message)

    def _drain(self) -> None:
        self.draining = True
        self.targets.close()  # no more probes: the decode models drain too
        for fwd in self.targets.all_inflight():
            _send_error(self.pb, fwd.sender, ErrorKind.OUT_OF_SERVICE, DRAIN_MESSAGE)

    def _forward(self, fwd: "Forwarding", target: str, attempt: int) -> None:
        refused = self._forward_once(fwd, target, attempt)
        self.targets.done(target, fwd)
        if refused is not None and fwd.attempt == attempt:
            self.targets.mark_failed(target, refused)
            self._reroute(fwd, target, refused)

    def _forward_once(self, fwd: "Forwarding", target: str, attempt: int):
        """Relay one attempt. Returns why the decode model did not take the request (its
        out-of-service error, or an error that is not ours, e.g. Triton's for a dead stub; the
        caller sends it elsewhere), or None when it is answered or failed for good."""
        pb = self.pb
        stop = threading.Event()
        request_id = f"front-{uuid.uuid4().hex}"
        # exec() below blocks until the first response; the watcher must run already
        threading.Thread(target=self._watch_cancel, args=(fwd.sender, target, request_id, stop), daemon=True).start()
        try:
            responses = pb.InferenceRequest(
                model_name=target, inputs=fwd.inputs, request_id=request_id, requested_output_names=self.outputs
            ).exec(decoupled=True)
            return self._relay(fwd, attempt, responses, target)
        except Exception as e:
            if fwd.attempt == attempt and not fwd.sender.closed:
                log.exception("forwarding to %s failed", target)
                _send_error(pb, fwd.sender, ErrorKind.INTERNAL, f"front model: {e}")
            return None
        finally:
            stop.set()

    def _relay(self, fwd: "Forwarding", attempt: int, responses, target: str):
        pb = self.pb
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        sender = fwd.sender
        for resp in responses:
            with fwd.lock:
                if fwd.attempt != attempt or sender.closed:  # superseded, or failed here already
                    return None
                if sender.is_cancelled():
                    return None
                if resp.has_error():
                    kind, message = parse_error(resp.error().message())
                    if not fwd.relayed and kind in (None, ErrorKind.OUT_OF_SERVICE):
                        return message  # not taken: Triton's answer for a dead stub, or ours
                    sender.send(pb.InferenceResponse(error=resp.error()), flags=final)
                    return None
                tensors = resp.output_tensors()
                if not tensors:
                    continue
                reason = pb.get_output_tensor_by_name(resp, "finish_reason")
                last = reason is not None and reason.as_numpy().reshape(-1)[0] not in (b"", "")
                sender.send(pb.InferenceResponse(output_tensors=tensors), flags=final if last else 0)
                fwd.relayed = True
                if last:
                    return None
        with fwd.lock:
            if fwd.attempt == attempt and not sender.closed and not sender.is_cancelled():
                sender.send(flags=final)
        return None

    def _watch_cancel(self, sender, target: str, request_id: str, stop: threading.Event) -> None:
        """When the client cancels, tell the decode model to cancel ``request_id`` at once, even
        before any token (e.g. while its prefill runs), so both sides free their pages. (This
        Triton's BLS response iterator has no cancel(); a control request does the job.)"""
        pb = self.pb
        while not stop.wait(0.05):
            if not sender.is_cancelled():
                continue
            control = pb.Tensor("cancel_request_id", np.array([request_id.encode()], dtype=object))
            try:
                for _ in pb.InferenceRequest(model_name=target, inputs=[control], requested_output_names=[]).exec(
                    decoupled=True
                ):
                    pass
                log.info("client cancelled %s; cancelled it on %s", request_id, target)
            except Exception as e:
                log.warning("could not cancel %s on %s: %s", request_id, target, e)
            return

    def finalize(self):
        self.drain.close()
        self.targets.close()
        self.metrics.close()


@dataclass(eq=False)
class Forwarding:
    """One client request on its way through the front. ``attempt``: the forwarding that owns
    the client's sender (a newer one supersedes an attempt stuck on a dead decode model);
    ``relayed``: some output reached the client (from then on it cannot move)."""

    sender: GuardedSender
    inputs: list
    token_ids: list = field(default_factory=list)  # the prompt, for routing
    pages: int = 1  # the pages it will hold on a decode model
    attempt: int = 0
    relayed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def _send_error(pb, sender: GuardedSender, kind: ErrorKind, message: str) -> None:
    try:
        sender.send(
            pb.InferenceResponse(error=triton_error(pb, kind, message)), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )
    except Exception:
        pass  # the final response went already


class FrontMetrics:
    """``triton_disagg_decode_target_up{model, target}``: 1 while the front routes to that decode
    model; ``triton_disagg_requests_active{model}``: requests the front is relaying;
    ``triton_disagg_router_query_tokens_total`` / ``_router_predicted_hit_tokens_total``: prompt
    tokens routed, and how many of them the chosen decode model was judged to cache."""

    def __init__(self, pb, model: str, targets: DecodeTargets, period_s: float = 0.25):
        self._targets = targets
        self._up_family = pb.MetricFamily(
            name="triton_disagg_decode_target_up",
            description="1 while the front model routes to this decode model (its health probes pass)",
            kind=pb.MetricFamily.GAUGE,
        )
        self._active_family = pb.MetricFamily(
            name="triton_disagg_requests_active",
            description="requests admitted and not finished in this instance",
            kind=pb.MetricFamily.GAUGE,
        )
        self._up = {t: self._up_family.Metric(labels={"model": model, "target": t}) for t in targets.states}
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
        threading.Thread(target=self._refresh, args=(period_s,), name="front-metrics", daemon=True).start()

    def _refresh(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            for name, up in self._targets.gauges().items():
                self._up[name].set(up)
            self._active.set(float(len(self._targets.all_inflight())))
            counters = self._targets.router_counters()
            for name, metric in self._router.items():
                metric.increment(counters[name] - self._router_seen[name])
                self._router_seen[name] = counters[name]

    def close(self) -> None:
        self._stop.set()
