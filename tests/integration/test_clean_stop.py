"""A stop after busy traffic is clean: Triton unloads every model within its exit timeout.

Our clients (``backend.client.stream_generate``, the OpenAI front end) cancel a gRPC stream only
while its request still runs. Cancelling a stream whose final response Triton is still writing
leaves that response in Triton's gRPC handler; it holds the model, which then never unloads, and
every stop ran into the exit timeout (about half the time with 10 concurrent streams).

A server whose model load hangs is given up on with an error that shows where it hangs (the
stubs' Python stacks, from the server's log), and a killed server leaves nothing in /dev/shm."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

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


HANGING_MODEL = """
import time

import backend.triton  # noqa: F401  (its stacks on SIGUSR1)


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(3600)  # a load that never ends

    def execute(self, requests):
        return None
"""


def test_a_load_that_hangs_is_given_up_on_with_its_stack_and_leaves_no_shared_memory(tmp_path):
    from backend.launch.server import TritonServer

    model = tmp_path / "repo" / "stuck"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(HANGING_MODEL)
    (model / "config.pbtxt").write_text(
        'name: "stuck"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n'
        'output [{ name: "y", data_type: TYPE_FP32, dims: [1] }]\n'
        "instance_group [{ kind: KIND_CPU, count: 1 }]\n"
    )
    server = TritonServer(tmp_path / "repo", log_file=tmp_path / "server.log")
    regions: list[str] = []
    real_dump = server.dump_stub_stacks

    def dump_and_note_regions():  # the stub is alive here: its region is in /dev/shm
        regions.extend(server.stub_shm_regions())
        real_dump()

    server.dump_stub_stacks = dump_and_note_regions
    with pytest.raises(TimeoutError) as info:
        server.start(timeout_s=8)
    message = str(info.value)
    assert "not ready after 8s" in message and "in initialize" in message and "model.py" in message, message
    assert regions and not any(Path("/dev/shm", r).exists() for r in regions), regions
