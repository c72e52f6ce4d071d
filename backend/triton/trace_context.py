"""The trace context a Triton request carries: its ``traceparent`` request parameter, which Triton
fills from the client's header or gRPC metadata (the server runs with
``--{http,grpc}-header-forward-pattern=traceparent``) and the front model sets on its calls to
decode models (``backend/cluster/tracing.py``)."""

from __future__ import annotations

import json
import logging

from backend.cluster.tracing import TRACE_HEADER

log = logging.getLogger("triton_disagg.tracing")


def traceparent_of(request) -> str:
    """The request's ``traceparent`` ("" when it has none, or its parameters cannot be read)."""
    try:
        params = json.loads(request.parameters() or "{}")
    except (ValueError, TypeError, AttributeError) as e:
        log.debug("the request's parameters cannot be read: %s", e)
        return ""
    value = params.get(TRACE_HEADER, "") if isinstance(params, dict) else ""
    return value if isinstance(value, str) else ""
