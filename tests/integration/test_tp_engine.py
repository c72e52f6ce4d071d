"""Tensor-parallel torch engine in-process: TP 3 (lead + 2 rank processes, gloo) against TP 1
on the real checkpoint: same greedy tokens, close logits, the KV shards are the TP 1 pool's
head slices, the layer hook fires only once every rank has written the layer, and a lost
rank takes the instance out at once."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from backend.engine.protocol import BatchEntry
from backend.engine.sampling_params import SamplingParams
from backend.parallel.lead import TPInstanceDown
from tests.engine_helpers import make_engine, real_model_dir, run_to_completion, tokens_of

PROMPTS = {"long": list(range(1000, 1090)), "short": [504, 3458, 282, 4649, 30], "one": [42]}


def greedy(engine, n):
    for req_id, ids in PROMPTS.items():
        engine.add_request(req_id, ids, SamplingParams(max_tokens=n, ignore_eos=True))
    return {r: tokens_of(o) for r, o in run_to_completion(engine).items()}


@pytest.fixture(scope="module")
def engines():
    model = real_model_dir()
    settings = dict(kv_cache_tokens=512, max_num_batched_tokens=32, num_threads=1)
    tp1 = make_engine(model, **settings)
    tp3 = make_engine(model, tensor_parallel_size=3, **settings)
    yield tp1, tp3
    tp3.runner.close()


def test_tp3_greedy_tokens_and_logits_match_tp1(engines):
    tp1, tp3 = engines
    assert greedy(tp3, 6) == greedy(tp1, 6)  # "long" runs in 3 chunks of the 32-token budget
    entry = [BatchEntry(list(range(10, 40)), 0, [0, 1])]
    r1, r3 = tp1.runner.run(entry), tp3.runner.run(entry)
    assert torch.allclose(r1.logits, r3.logits, atol=2e-4, rtol=0), (r1.logits - r3.logits).abs().max()
    # each rank's shard holds exactly its KV head of the TP 1 pool
    pools = tp3.runner.shard_pools()
    assert len(pools) == 3 and pools[0].shape[3] == 1
    full = torch.cat(pools, dim=3)[:, :2]
    assert torch.allclose(full, tp1.pool.tensor[:, :2], atol=1e-4), (full - tp1.pool.tensor[:, :2]).abs().max()


def test_layer_hook_fires_after_every_rank_wrote_the_layer(engines):
    _, tp3 = engines
    pools = tp3.runner.shard_pools()
    for p in pools:
        p[:, 5].zero_()
    seen = []

    def hook(layer, arg):
        written = [bool(p[layer, 5, :, :, :4].abs().sum() > 0) for p in pools]
        later = [bool(p[layer + 1 :, 5].abs().sum() > 0) for p in pools] if layer + 1 < len(pools[0]) else []
        seen.append((layer, arg, all(written), any(later)))

    tp3.runner.on_layer_kv_written = hook
    try:
        tp3.runner.run([BatchEntry([1, 2, 3, 4], 0, [5])], hook_arg="step")
    finally:
        tp3.runner.on_layer_kv_written = None
    assert [s[0] for s in seen] == list(range(30))
    assert all(arg == "step" and all_written and not later for _, arg, all_written, later in seen)


def test_killed_rank_takes_the_instance_out():
    tp3 = make_engine(real_model_dir(), tensor_parallel_size=3, kv_cache_tokens=256, num_threads=1)
    try:
        events = []
        tp3.on_out_of_service(events.append)
        os.kill(tp3.runner.ranks.pids()[1], signal.SIGKILL)
        t0 = time.monotonic()
        tp3.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
        outs = run_to_completion(tp3)["r"]
        assert outs[-1].finish_reason == "error" and "out of service" in outs[-1].error, outs[-1]
        assert time.monotonic() - t0 < 20
        assert len(events) == 1 and "rank 2" in events[0] and "signal 9" in events[0], events
        with pytest.raises(TPInstanceDown):
            tp3.runner.run([BatchEntry([1], 0, [0])])
        assert all(p.poll() is not None for p in tp3.runner.ranks.procs)
    finally:
        tp3.runner.close()
