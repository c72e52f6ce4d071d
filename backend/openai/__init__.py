"""The OpenAI-compatible HTTP frontend: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` and ``/health`` in front of a running deployment, spoken to over
Triton's gRPC streaming API (tritonclient's asyncio client). ``schemas.py``: the request and
response bodies; ``triton_stream.py``: one generation against Triton; ``app.py``: the ASGI app;
``__main__.py``: the server process (uvicorn)."""
