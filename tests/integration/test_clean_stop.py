"""A stop after busy traffic is clean: Triton unloads every model within its exit timeout.

Our clients (``backend.client.stream_generate``, the OpenAI front end) cancel a gRPC stream only
while its request still runs. Cancelling a stream whose final response Triton is still writing
leaves that response in Triton's gRPC handler; it holds the model, which then never unloads, and
every stop ran into the exit timeout (about half the time with 10 concurrent streams)."""

from __future__ import annotations

import threading
from pathlib import Path

from backend.client import stream_generate
from tests.conftest import deployment_server


def test_stop_after_concurrent_streams_unloads_every_model(model_dir, tmp_path_factory):
    results = [None] * 10
    with deployment_server(
        tmp_path_factory, "clean_stop", mode="aggregated", model_path=str(model_dir), overrides={"num_threads": "2"}
    ) as server:
        log_file = Path(server.log_file)

        def one(i):
            results[i] = stream_generate(server.grpc_url, f"Tell me about item {i}.", 5, ignore_eos=True)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
        for t in threads:
            t.start()
        [t.join(120) for t in threads]
        assert all(r is not None and r.error is None and len(r.token_ids) == 5 for r in results), [
            r and r.error for r in results
        ]
    log = log_file.read_text(errors="replace")
    assert "successfully unloaded 'llm'" in log and "Exit timeout expired" not in log, log[-3000:]
