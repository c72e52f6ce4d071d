"""The decode side's KV deadline does not count the time a request waits in the prefill
instance's queue: the prefill reports when it starts a request (``PrefillStarted``) and
``kv_transfer_timeout_s`` runs from then, as the longest time without a landed write; the
queueing has its own bound (``prefill_queue_timeout_s``), and a timeout says which of the two
expired."""

from __future__ import annotations

import threading
import time

import pytest

from backend.client import stream_generate
from tests.conftest import deployment_server, wait_pool_free

pytestmark = pytest.mark.usefixtures("nixl")

TRANSFER_TIMEOUT_S = 5.0
PROMPT = "Summarise: " + " ".join(f"item{i} costs {i * 3} coins;" for i in range(90))


@pytest.fixture(scope="module")
def queue_server(model_dir, tmp_path_factory):
    """One prefill instance that runs one request at a time; decode_1 allows 1 s of queueing."""
    with deployment_server(
        tmp_path_factory,
        "kv_deadline",
        timeout_s=400,
        mode="disagg",
        model_path=str(model_dir),
        prefill_instances=1,
        decode_instances=2,
        overrides={
            "kv_cache_tokens": "8192",
            "max_num_batched_tokens": "256",
            "num_threads": "1",
            "kv_transfer_timeout_s": str(TRANSFER_TIMEOUT_S),
            "kv_quarantine_s": "4",
        },
        per_model={
            "prefill": {"max_num_seqs": "1"},
            "decode_1": {"prefill_queue_timeout_s": "1", "kv_load_failure_policy": "fail"},
        },
    ) as server:
        yield server


def test_queueing_at_the_prefill_does_not_count_against_the_transfer_deadline(queue_server):
    url = queue_server.grpc_url
    results, times = [None] * 5, [0.0] * 5

    def run(i):
        t0 = time.monotonic()
        # distinct from the first token on: no request reuses another's prefix (prefix caching)
        results[i] = stream_generate(url, f"Case {i}. {PROMPT}", 4, model="decode_0", ignore_eos=True, timeout_s=120)
        times[i] = time.monotonic() - t0

    threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    time.sleep(0.5)  # decode_0's requests now queue at the prefill instance, which takes one at a time
    queued = stream_generate(url, PROMPT, 4, model="decode_1", ignore_eos=True, timeout_s=60)
    for t in threads:
        t.join(180)
    assert all(r.error is None and len(r.token_ids) == 4 for r in results), [r.error for r in results]
    # the last of them waited longer than the transfer deadline in all, and still succeeded
    assert max(times) > TRANSFER_TIMEOUT_S, times
    assert queued.error and queued.error.startswith("[kv_transfer_failed]"), queued.error
    assert "timeout (queued at the prefill instance)" in queued.error, queued.error
    for model in ("prefill_0", "decode_0", "decode_1"):
        wait_pool_free(queue_server.metrics_url, model, timeout_s=30)
    again = stream_generate(url, PROMPT, 4, model="decode_1", ignore_eos=True)
    assert again.error is None and len(again.token_ids) == 4, again.error


def test_a_prefill_longer_than_the_transfer_deadline_succeeds_while_its_layers_land(queue_server):
    """``kv_transfer_timeout_s`` bounds the time without a landed write, not the whole prefill:
    a 2,400-token prompt (about 10 chunks of 256 tokens on one engine thread) takes longer than
    the 5 s deadline, and each chunk's layers land as they are written."""
    long_prompt = "Summarise: " + " ".join(f"row {i} holds {i * 13} units;" for i in range(200))
    t0 = time.monotonic()
    res = stream_generate(queue_server.grpc_url, long_prompt, 4, model="decode_0", ignore_eos=True, timeout_s=180)
    elapsed = time.monotonic() - t0
    assert res.error is None and len(res.token_ids) == 4, res.error
    assert elapsed > TRANSFER_TIMEOUT_S, f"the prefill took {elapsed:.1f}s: too short to outlast the deadline"
    for model in ("prefill_0", "decode_0"):
        wait_pool_free(queue_server.metrics_url, model, timeout_s=30)
