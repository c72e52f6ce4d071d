"""The OpenAI-compatible HTTP frontend: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``, ``/health`` and ``/metrics`` in front of a running deployment, spoken to
over Triton's gRPC streaming API (tritonclient's asyncio client). ``schemas.py``: the request and
response bodies; ``triton_stream.py``: one generation (or readiness probe) against Triton;
``router.py``: with ``--discovery``, which decode instance a request goes to and where it moves
when that one fails it; ``fleet.py``: those instances from etcd's membership, probed over gRPC;
``metrics.py``: the ``/metrics`` text; ``app.py``: the ASGI app; ``__main__.py``: the server
process (uvicorn)."""
