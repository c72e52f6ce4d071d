"""Triton Python-backend model for the client-facing roles (aggregated ``llm``, ``decode``).

``execute()`` only hands each request to :class:`Admission` (parse, validate, tokenize,
enqueue); the worker's responder thread streams responses through each request's response sender
(decoupled model). The ``role`` parameter picks the worker: ``aggregated`` (one engine, chunked
prefill + decode) or ``decode`` (KV from prefill instances, ``backend/serving/decode_worker.py``).
The one control request, for a front model that reaches this server's decode models by BLS (a
repository started without the launcher; BLS calls cannot be cancelled): ``cancel_request_id``
cancels the request with that Triton request id. Everything else about the instance travels
apart from its inputs: a decode instance writes its health (why it cannot serve) and cache
summary into its membership record (``backend/serving/discovery.py``), routers probe Triton's
own model readiness, and ``triton-disagg drain`` reaches it through its drain key in etcd
(``backend/serving/drain.py``) and drains it (its record then says ``draining``). When the deployment stops
(``backend/triton/lifecycle.py``) the instance drains the same way, and at unload whatever is
still in flight ends.
"""

from __future__ import annotations

import logging
from functools import partial

from backend.disagg import auth
from backend.serving.admission import Admission
from backend.serving.config import InstanceConfig
from backend.serving.drain import watch_drain_requests
from backend.serving.roles import make_worker
from backend.serving.session import GenerationSession
from backend.serving.stats import InstanceStats
from backend.triton.lifecycle import DRAIN_MESSAGE, DrainWatch, request_reload
from backend.triton.metrics import InstanceMetrics
from backend.triton.model_args import init_model
from backend.triton.sender import TritonSink
from backend.triton.trace_context import traceparent_of

log = logging.getLogger("triton_disagg.model")


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        pb_utils, cfg, params, self.instance = init_model(args)
        self.pb = pb_utils
        config = InstanceConfig.from_parameters(params)  # an unknown or bad parameter fails the load
        tokenizer = AutoTokenizer.from_pretrained(config.engine.model_path)
        self.worker = make_worker(config, self.instance, cfg["name"])
        # a tensor-parallel instance that lost a rank: the server's supervisor loads it again
        self.worker.on_out_of_service(partial(request_reload, args["model_repository"], cfg["name"]))
        self.admission = Admission(config, self.worker, tokenizer, self.instance, on_done=self._on_done)
        self.metrics = InstanceMetrics(
            pb_utils,
            {"model": cfg["name"], "instance": self.instance},
            self._stats,
            observations=self.worker.observations,
        )
        self.drain_timeout_s = config.serving.drain_timeout_s
        secret = auth.load_secret(config.membership.deployment_secret_file) if config.role == "decode" else None
        self.drain = DrainWatch(
            args["model_repository"],
            lambda: self.admission.drain_gracefully(DRAIN_MESSAGE, self.drain_timeout_s),
            on_drain_now=lambda: self.admission.drain(DRAIN_MESSAGE),
        )
        name = self.worker.member_name()
        self.drain_requests = watch_drain_requests(
            config,
            name,
            secret,
            lambda: self.admission.drain_gracefully(
                f"instance {name} drains (triton-disagg drain)", self.drain_timeout_s
            ),
        )
        log.info(
            "instance %s ready: role %s, model %s, %s",
            self.instance,
            config.role,
            config.engine.model_path,
            self.worker.describe(),
        )

    def _stats(self) -> InstanceStats:
        stats = self.worker.stats()
        stats.requests_active = self.admission.active()
        stats.trace_spans_dropped_total = self.admission.tracer.stats()["spans_dropped"]
        return stats

    def execute(self, requests):
        pb = self.pb
        for request in requests:
            sink = TritonSink(pb, request)

            def get(name, request=request):
                t = pb.get_input_tensor_by_name(request, name)
                return None if t is None else t.as_numpy()

            cancel_id = get("cancel_request_id")
            if cancel_id is not None:  # a control request: cancel another request (see the front model)
                self.admission.cancel_by_external_id(cancel_id.reshape(-1)[0].decode())
                sink.sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            self.admission.admit(get, sink, request.request_id(), traceparent_of(request))
        return None

    def _on_done(self, session: GenerationSession, reason: str) -> None:
        self.metrics.add("requests_total", 1)
        self.metrics.add("output_tokens_total", session.n_output)
        if reason == "error":
            self.metrics.add("requests_failed_total", 1)
        if session.t_first is not None:
            self.metrics.add("ttft_seconds_total", session.t_first - session.t_start)
            self.metrics.observe("time_to_first_token_seconds", session.t_first - session.t_start)
        if session.token_gaps:
            self.metrics.observe("inter_token_latency_seconds", session.token_gaps)
        if reason not in ("error", "cancelled", "send-failed") and session.t_end is not None:
            self.metrics.observe("e2e_request_latency_seconds", session.t_end - session.t_start)

    def finalize(self):
        log.info("instance %s shutting down", self.instance)
        self.drain.close()
        if self.drain_requests is not None:
            self.drain_requests.close()
        self.admission.drain(DRAIN_MESSAGE)
        self.admission.close()
        self.worker.shutdown()
        self.metrics.close()
