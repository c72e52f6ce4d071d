"""Triton Python-backend front model of the disaggregated deployment.

Clients call it with the same tensors as the aggregated ``llm`` model. It sends each request
to one decode model (least requests in flight; the decode models are listed in the
``decode_models`` parameter) with a decoupled BLS call and streams the responses back as they
arrive. A response whose ``finish_reason`` is set is the last one. A client that cancels
gets its request cancelled on the decode model by a control request (``cancel_request_id``),
so the decode instance (and the prefill instance working for it) stop and free their pages.
"""

from __future__ import annotations

import logging
import threading
import uuid

import numpy as np

from backend.engine.outputs import ErrorKind
from backend.serving.config import FrontConfig
from backend.serving.errors import parse_error
from backend.serving.tensors import OUTPUTS
from backend.triton.model_args import init_model
from backend.triton.sender import GuardedSender, triton_error

log = logging.getLogger("triton_disagg.front")


class TritonPythonModel:
    def initialize(self, args):
        self.pb, cfg, params, _ = init_model(args)
        self.targets = FrontConfig.from_parameters(params).targets()
        self.outputs = [o.name for o in OUTPUTS]
        self.inflight = {t: 0 for t in self.targets}
        self.out_of_service: set[str] = set()  # decode models that answered with kind out_of_service
        self._lock = threading.Lock()
        log.info("front model %s: routing to %s", cfg["name"], self.targets)

    def execute(self, requests):
        for request in requests:
            sender = GuardedSender(self.pb, request.get_response_sender())
            inputs = [self.pb.Tensor(t.name(), t.as_numpy()) for t in request.inputs()]
            with self._lock:
                live = [t for t in self.targets if t not in self.out_of_service] or self.targets
                target = min(live, key=lambda t: self.inflight[t])
                self.inflight[target] += 1
            threading.Thread(target=self._forward, args=(sender, target, inputs), daemon=True).start()
        return None

    def _forward(self, sender, target: str, inputs) -> None:
        pb = self.pb
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        stop = threading.Event()
        request_id = f"front-{uuid.uuid4().hex}"
        # exec() below blocks until the first response; the watcher must run already
        threading.Thread(target=self._watch_cancel, args=(sender, target, request_id, stop), daemon=True).start()
        try:
            responses = pb.InferenceRequest(
                model_name=target, inputs=inputs, request_id=request_id, requested_output_names=self.outputs
            ).exec(decoupled=True)
            if not self._relay(sender, responses, target) and not sender.is_cancelled():
                sender.send(flags=final)
        except Exception as e:
            log.exception("forwarding to %s failed", target)
            try:
                sender.send(
                    pb.InferenceResponse(error=triton_error(pb, ErrorKind.INTERNAL, f"front model: {e}")), flags=final
                )
            except Exception:
                pass
        finally:
            stop.set()
            with self._lock:
                self.inflight[target] -= 1

    def _relay(self, sender, responses, target: str) -> bool:
        """Pass responses on until the last one; True if a final response was sent."""
        pb = self.pb
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for resp in responses:
            if sender.is_cancelled():
                return False
            if resp.has_error():
                kind, _ = parse_error(resp.error().message())
                if kind is ErrorKind.OUT_OF_SERVICE:
                    log.warning("decode model %s is out of service; routing around it", target)
                    with self._lock:
                        self.out_of_service.add(target)
                sender.send(pb.InferenceResponse(error=resp.error()), flags=final)
                return True
            tensors = resp.output_tensors()
            if not tensors:
                continue
            reason = pb.get_output_tensor_by_name(resp, "finish_reason")
            last = reason is not None and reason.as_numpy().reshape(-1)[0] not in (b"", "")
            sender.send(pb.InferenceResponse(output_tensors=tensors), flags=final if last else 0)
            if last:
                return True
        return False

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
        pass
