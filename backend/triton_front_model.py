"""Triton Python-backend front model of the disaggregated deployment.

Clients call it with the same tensors as the aggregated ``llm`` model. It sends each request
to one decode model (least requests in flight; the decode models are listed in the
``decode_models`` parameter) with a decoupled BLS call and streams the responses back as they
arrive. A response whose ``finish_reason`` is set is the last one. A client that cancels
cancels the BLS request, so the decode instance stops and frees its pages.
"""
from __future__ import annotations

import logging
import threading

from backend.triton_model import init_model

log = logging.getLogger("triton_disagg.front")


class TritonPythonModel:
    def initialize(self, args):
        self.pb, cfg, params, _ = init_model(args)
        self.targets = [m.strip() for m in params.get("decode_models", "").split(",") if m.strip()]
        if not self.targets:
            raise ValueError("front model: parameter 'decode_models' lists no decode model")
        self.outputs = [o["name"] for o in cfg["output"]]
        self.inflight = {t: 0 for t in self.targets}
        self._lock = threading.Lock()
        log.info("front model %s: routing to %s", cfg["name"], self.targets)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            inputs = [self.pb.Tensor(t.name(), t.as_numpy()) for t in request.inputs()]
            with self._lock:
                target = min(self.targets, key=lambda t: self.inflight[t])
                self.inflight[target] += 1
            threading.Thread(target=self._forward, args=(sender, target, inputs), daemon=True).start()
        return None

    def _forward(self, sender, target: str, inputs) -> None:
        pb = self.pb
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        done = False
        try:
            responses = pb.InferenceRequest(model_name=target, inputs=inputs,
                                            requested_output_names=self.outputs).exec(decoupled=True)
            for resp in responses:
                if sender.is_cancelled():
                    responses.cancel()
                    log.info("client cancelled; cancelled the request on %s", target)
                    done = True
                    break
                if resp.has_error():
                    sender.send(pb.InferenceResponse(error=resp.error()), flags=final)
                    done = True
                    break
                tensors = resp.output_tensors()
                if not tensors:
                    continue
                reason = pb.get_output_tensor_by_name(resp, "finish_reason")
                last = reason is not None and reason.as_numpy().reshape(-1)[0] not in (b"", "")
                sender.send(pb.InferenceResponse(output_tensors=tensors), flags=final if last else 0)
                if last:
                    done = True
                    break
            if not done and not sender.is_cancelled():
                sender.send(flags=final)
        except Exception as e:
            log.exception("forwarding to %s failed", target)
            try:
                sender.send(pb.InferenceResponse(error=pb.TritonError(f"front model: {e}")), flags=final)
            except Exception:
                pass
        finally:
            with self._lock:
                self.inflight[target] -= 1

    def finalize(self):
        pass
