"""The trace context a Triton request carries, from two sources:

- Triton's own trace (``request.trace().get_context()``): with ``--otlp-endpoint`` the server runs
  Triton's OpenTelemetry trace mode (``backend/launch/server.py``), which reads the W3C
  ``traceparent`` header of HTTP (``infer``, ``generate``, ``generate_stream``) and gRPC requests,
  exports Triton's own spans (the request, the model, its compute) and hands the model its
  model span's context, in the client's trace;
- the ``traceparent`` request parameter: a field of ``generate``'s JSON body that is not an input
  (for clients that cannot set headers), or the header itself where Triton forwards it
  (``--{http,grpc}-header-forward-pattern=traceparent``: gRPC metadata and HTTP ``infer``; the
  front model sends it so on its calls to decode models, ``backend/serving/decode_stream.py``).

:func:`traceparent_of` takes Triton's context when it continues the parameter's trace (then
Triton's spans sit between the caller's and ours) or when there is no parameter; otherwise the
parameter (a body field names the client's trace; Triton, which saw no header, started a new one).
"""

from __future__ import annotations

import json
import logging

from backend.cluster.tracing import TRACE_HEADER

log = logging.getLogger("triton_disagg.tracing")


def _parameter(request) -> str:
    """The request's ``traceparent`` parameter, by any case (HTTP header names are not
    case-sensitive, and Triton forwards them as the client spelt them)."""
    try:
        params = json.loads(request.parameters() or "{}")
    except (ValueError, TypeError, AttributeError) as e:
        log.debug("the request's parameters cannot be read: %s", e)
        return ""
    if not isinstance(params, dict):
        return ""
    for key, value in params.items():
        if key.lower() == TRACE_HEADER and isinstance(value, str):
            return value
    return ""


def _tritons(request) -> str:
    """The context of Triton's own span for this request ("" when Triton does not trace it)."""
    try:
        context = request.trace().get_context()
    except (AttributeError, TypeError, RuntimeError) as e:  # no trace API, or none for this request
        log.debug("the request's Triton trace cannot be read: %s", e)
        return ""
    if not context:
        return ""
    try:
        value = json.loads(context).get(TRACE_HEADER, "")
    except (ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) else ""


def _trace_id(traceparent: str) -> str:
    parts = traceparent.split("-")
    return parts[1].lower() if len(parts) == 4 else ""


def traceparent_of(request) -> str:
    """The request's W3C ``traceparent`` ("" when it has none)."""
    param, tritons = _parameter(request), _tritons(request)
    if tritons and (not param or _trace_id(param) == _trace_id(tritons)):
        return tritons
    return param
