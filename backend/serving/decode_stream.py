"""The stream client both fronts reach a decode model with (the Triton front model,
``backend/triton/front_model.py``, and the OpenAI frontend, ``backend/openai/``): a
:class:`DecodeLink` opens an attempt of a request there (the request's tensors in, each response
out as a :class:`Reply`: an error message, or the output arrays) and probes its readiness
(Triton's own: the model is loaded and ready; a control call, nothing through the decode model's
inputs). One interface, so one relay and one prober (``backend/serving/target_watch.py``) serve
every kind of link:

- :class:`GrpcLink`: a decode model at a known gRPC address (its membership record's
  ``grpc_url``; the Triton front's own server's, from the launcher), by a tritonclient gRPC
  stream per attempt; cancelling stops the stream with Triton's request cancellation, which
  frees the request's pages there. A finished attempt's stream is closed without cancelling
  (cancelling a call whose final response Triton still writes leaves that response in Triton's
  gRPC handler, holding the model). When the front dies, its streams' connections close and
  Triton cancels the requests there.
- the Triton front's BLS link to a decode model of its own server (``backend/triton/decode_link.py``:
  it needs the Python backend's utilities, so it lives there).

A broken call (the server died: connection reset, unavailable) is a :class:`Reply` whose error
has no kind of ours, like Triton's answer for a dead stub: the request may move.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from backend.cluster.tracing import TRACE_HEADER
from backend.serving.errors import parse_error
from backend.serving.routing import Target

log = logging.getLogger("triton_disagg.front")


@dataclass
class Reply:
    """One response of a decode model: ``error`` (its message) or ``outputs`` (name -> array);
    ``unanswered``: the error says no answer came: the call itself failed (it could not start,
    broke, or timed out), so nothing was said about the request."""

    error: str | None = None
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    unanswered: bool = False


class Attempt(Protocol):
    local: bool  # on this server (BLS)

    def replies(self) -> Iterator[Reply]:
        """The responses until the final one (or an error, or a broken call)."""
        ...

    def cancel(self) -> None:
        """Cancel the request there (the client went away, or it moved elsewhere)."""
        ...

    def finish(self) -> None:
        """The relay is done with it (after its end, or a cancel)."""
        ...


class DecodeLink(Protocol):
    target: Target

    def open(self, request_id: str, inputs: dict[str, np.ndarray], traceparent: str = "") -> Attempt:
        """Send the request with ``traceparent``, the attempt's trace context, when it is set (gRPC:
        the call's metadata, which Triton forwards as the request parameter of that name; BLS:
        that parameter)."""
        ...

    def probe(self) -> Reply:
        """Whether Triton has the decode model ready: a reply without an error if so."""
        ...

    def close(self) -> None: ...


_END = object()


class GrpcLink:
    """A decode model at a gRPC address; ``timeout_s`` bounds a probe. Probes, one at a time,
    share one client (one channel, kept while the server answers); each attempt has its own."""

    def __init__(self, target: Target, timeout_s: float):
        self.target, self.timeout_s = target, timeout_s
        self._probe_client: Any = None  # a tritonclient gRPC client

    def open(self, request_id: str, inputs: dict[str, np.ndarray], traceparent: str = "") -> Attempt:
        return _GrpcAttempt(self.target, request_id, inputs, traceparent)

    def probe(self) -> Reply:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        url, model = self.target.grpc_url, self.target.model
        try:
            if self._probe_client is None:
                self._probe_client = grpcclient.InferenceServerClient(url)
            ready = self._probe_client.is_model_ready(model, client_timeout=self.timeout_s)
        except InferenceServerException as e:
            self.close()  # a fresh channel next time
            return Reply(error=f"Triton at {url}: {e.message()}", unanswered=True)
        return Reply() if ready else Reply(error=f"Triton at {url}: decode model {model} is not ready")

    def close(self) -> None:
        client, self._probe_client = self._probe_client, None
        if client is not None:
            try:
                client.close()
            except Exception as e:
                log.debug("closing the probe channel to %s: %s", self.target.grpc_url, e)


class _GrpcAttempt:
    """One gRPC stream, on a client of its own (tritonclient's synchronous client has one stream
    at a time)."""

    local = False

    def __init__(self, target: Target, request_id: str, inputs: dict[str, np.ndarray], traceparent: str = ""):
        self.target, self.request_id, self.inputs, self.traceparent = target, request_id, inputs, traceparent
        self._queue: queue.Queue = queue.Queue()
        self._client: Any = None  # a tritonclient gRPC client
        self._started = False
        self._lock = threading.Lock()
        self._closed = False
        self.broken = False  # the call failed (not an answer of the model)

    def replies(self) -> Iterator[Reply]:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException, np_to_triton_dtype

        try:
            with self._lock:
                if self._closed:
                    return
                if self._client is None:
                    self._client = grpcclient.InferenceServerClient(self.target.grpc_url)
                client = self._client
            # the trace context as the call's metadata: the server's Triton forwards it to the model
            # as a request parameter and, tracing, continues the trace with its own spans
            client.start_stream(
                callback=lambda result, error: self._queue.put((result, error)),
                headers={TRACE_HEADER: self.traceparent} if self.traceparent else None,
            )
            self._started = True
            tensors = []
            for name, arr in self.inputs.items():
                t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
                t.set_data_from_numpy(arr)
                tensors.append(t)
            client.async_stream_infer(
                self.target.model, tensors, request_id=self.request_id, enable_empty_final_response=True
            )
        except InferenceServerException as e:
            self.broken = True
            yield Reply(error=f"Triton at {self.target.grpc_url}: {e.message()}", unanswered=True)
            return
        while True:
            item = self._queue.get()
            if item is _END:
                return
            result, error = item
            if error is not None:
                message = str(error.message()) if hasattr(error, "message") else str(error)
                self.broken = parse_error(message)[0] is None  # not an answer of our model's
                if getattr(error, "status", lambda: None)() is not None:  # the call broke (a gRPC status)
                    yield Reply(error=f"Triton at {self.target.grpc_url}: {message}", unanswered=True)
                else:
                    yield Reply(error=message)
                return
            response = result.get_response()
            outputs_now = {}
            for out in response.outputs:
                arr = result.as_numpy(out.name)
                if arr is not None:
                    outputs_now[out.name] = arr
            yield Reply(outputs=outputs_now)
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return

    def finish(self) -> None:
        """The request ended: close the stream without cancelling (Triton ends the call)."""
        self._stop(cancel=False)

    def cancel(self) -> None:
        self._stop(cancel=True)

    def _stop(self, cancel: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client = self._client
        self._queue.put(_END)
        if client is None or not self._started:
            return
        cancel = cancel or self.broken  # a call that failed or hangs: never wait for it to end

        def stop() -> None:
            try:
                client.stop_stream(cancel_requests=cancel)
                client.close()
            except Exception as e:  # a dead server: nothing to close there
                log.debug("closing the stream to %s: %s", self.target.grpc_url, e)

        threading.Thread(target=stop, name="front-grpc-close", daemon=True).start()
