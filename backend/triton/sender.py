"""Sending responses from other threads: :class:`GuardedSender`, a Triton decoupled response
sender that is safe to poll, and :class:`TritonSink`, a session's responses as Triton tensors
and errors (with their kind and a fitting Triton error code).

Triton frees a request's response factory once the final response is sent; calling
``is_cancelled()`` on it after that (or at the same moment, from a watcher thread) crashes
the server. This wrapper serialises ``send`` and ``is_cancelled`` and never touches the
sender again after the final response: ``is_cancelled()`` then answers False. Each
``is_cancelled()`` asks Triton's process (a round trip over the Python backend's IPC, about as
costly as a response); streams ask before every token, so the wrapper asks Triton at most every
``CANCEL_POLL_S`` and answers from the last reply between: a cancel is seen within that time.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from backend.engine.outputs import ErrorKind
from backend.serving.errors import format_error

CANCEL_POLL_S = 0.05


class GuardedSender:
    def __init__(self, pb_utils, sender):
        self._pb = pb_utils
        self._sender = sender
        self._lock = threading.Lock()
        self.closed = False
        self._cancelled = False
        self._next_poll = 0.0  # time.monotonic() from which Triton is asked again

    def send(self, response=None, flags: int = 0) -> None:
        final = bool(flags & self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        with self._lock:
            if self.closed:
                raise RuntimeError("the final response was already sent")
            if final:
                self.closed = True
            sender = self._sender
            if final:  # let go of Triton's response factory: a model holding one cannot unload
                self._sender = None
            if response is None:
                sender.send(flags=flags)
            else:
                sender.send(response, flags=flags)

    def is_cancelled(self) -> bool:
        with self._lock:
            if self.closed:
                return False
            now = time.monotonic()
            if not self._cancelled and now >= self._next_poll:
                self._next_poll = now + CANCEL_POLL_S
                self._cancelled = self._sender.is_cancelled()
            return self._cancelled


def triton_error(pb_utils, kind: ErrorKind, message: str):
    """A ``TritonError`` whose message carries the kind (``[kind] message``) and whose code fits
    it, so HTTP clients get a fitting status (400 for bad input, 503 when to retry later)."""
    e = pb_utils.TritonError
    codes = {
        ErrorKind.BAD_REQUEST: e.INVALID_ARG,
        ErrorKind.OVERLOADED: e.UNAVAILABLE,
        ErrorKind.OUT_OF_SERVICE: e.UNAVAILABLE,
        ErrorKind.DRAINING: e.UNAVAILABLE,
        ErrorKind.PREFILL_UNAVAILABLE: e.UNAVAILABLE,
    }
    return e(format_error(kind, message), codes.get(kind, e.INTERNAL))


class TritonSink:
    """Sends a session's responses through a Triton decoupled response sender."""

    def __init__(self, pb_utils, request):
        self.pb = pb_utils
        self.sender = GuardedSender(pb_utils, request.get_response_sender())

    def send(self, text, token_ids, n_input, n_output, finish_reason, final, extras=None):
        pb = self.pb
        tensors = [
            pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object)),
            pb.Tensor("output_token_ids", np.asarray(token_ids, dtype=np.int32)),
            pb.Tensor("num_input_tokens", np.array([n_input], dtype=np.int32)),
            pb.Tensor("num_output_tokens", np.array([n_output], dtype=np.int32)),
            pb.Tensor("finish_reason", np.array([str(finish_reason).encode()], dtype=object)),
        ]
        tensors += [pb.Tensor(name, array) for name, array in (extras or {}).items()]
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self.sender.send(pb.InferenceResponse(output_tensors=tensors), flags=flags)

    def error(self, message: str, kind: ErrorKind):
        """The error, then the final flag alone. An error response that carried the final flag,
        sent from one of our threads after ``execute()`` returned (the requests a drain ends at
        its window), never reached the front model's BLS call: the stream hung (seen 2026-12-05
        with this Triton). Sent apart, the end of the stream does reach it (the error's text
        does not: the front sees a stream that ended unfinished, and moves the request); gRPC
        clients get the error, then the end of the stream."""
        pb = self.pb
        self.sender.send(pb.InferenceResponse(error=triton_error(pb, kind, message)))
        self.sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def close(self):
        """The final flag without a response, unless the final response went already."""
        if not self.sender.closed:
            self.sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def is_cancelled(self):
        return self.sender.is_cancelled()
