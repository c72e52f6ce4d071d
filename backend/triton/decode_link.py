"""The Triton front model's link to a decode model of its own server when the server's gRPC
address is unknown (a repository started without the launcher): a decoupled BLS call, behind the
same :class:`DecodeLink` interface as the gRPC stream client (``backend/serving/decode_stream.py``).
A client's cancellation reaches it as a control request (``cancel_request_id``; this Triton's BLS
response iterator has no cancel()); it is taken as ready (:meth:`BlsLink.probe`). A decode model's
response to a BLS caller whose stub died never returns (Triton's Python backend waits on the dead
stub): that decode instance stops serving.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np

from backend.cluster.tracing import TRACE_HEADER
from backend.serving.decode_stream import Attempt, Reply
from backend.serving.routing import Target

log = logging.getLogger("triton_disagg.front")


class BlsLink:
    """A decode model of this server (BLS)."""

    def __init__(self, pb_utils, target: Target, outputs: list[str]):
        self.pb, self.target, self._outputs = pb_utils, target, outputs

    def open(self, request_id: str, inputs: dict[str, np.ndarray], traceparent: str = "") -> Attempt:
        return _BlsAttempt(self, request_id, inputs, traceparent)

    def probe(self) -> Reply:
        """Ready: this Triton's BLS ``is_model_ready``, called from a thread of ours, crashes the
        calling stub (seen 2026-12-05, Triton 2.51), so a decode model of this server reached by
        BLS is taken as ready; a failure shows in its streams (they count as failed probes)."""
        return Reply()

    def _reply(self, resp) -> Reply:
        if resp.has_error():
            return Reply(error=resp.error().message())
        return Reply(outputs={t.name(): t.as_numpy() for t in resp.output_tensors()})

    def close(self) -> None:
        pass


class _BlsAttempt:
    local = True

    def __init__(self, link: BlsLink, request_id: str, inputs: dict[str, np.ndarray], traceparent: str):
        self.link, self.request_id, self.inputs, self.traceparent = link, request_id, inputs, traceparent

    def replies(self) -> Iterator[Reply]:
        pb, link = self.link.pb, self.link
        kw = {"parameters": {TRACE_HEADER: self.traceparent}} if self.traceparent else {}
        request = pb.InferenceRequest(
            model_name=link.target.model,
            inputs=[pb.Tensor(name, arr) for name, arr in self.inputs.items()],
            request_id=self.request_id,
            requested_output_names=link._outputs,
            **kw,
        )
        for resp in request.exec(decoupled=True):
            yield link._reply(resp)

    def finish(self) -> None:
        pass  # a BLS call ends with its final response

    def cancel(self) -> None:
        pb, model = self.link.pb, self.link.target.model
        control = pb.Tensor("cancel_request_id", np.array([self.request_id.encode()], dtype=object))
        try:
            for _ in pb.InferenceRequest(model_name=model, inputs=[control], requested_output_names=[]).exec(
                decoupled=True
            ):
                pass
            log.info("cancelled %s on %s", self.request_id, model)
        except Exception as e:
            log.warning("could not cancel %s on %s: %s", self.request_id, model, e)
