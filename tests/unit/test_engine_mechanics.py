"""Engine mechanics on a tiny random Llama: chunked prefill, batching, stops, aborts, errors, pages."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    TINY_VOCAB,
    RemoteLoader,
    admit_remote,
    assert_pool_idle,
    build_tiny_llama,
    make_engine,
    prompt_of,
    run_to_completion,
    tokens_of,
)

from backend.engine.outputs import ErrorKind
from backend.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture
def engine(tiny_dir):
    engine = make_engine(tiny_dir, max_num_batched_tokens=16, kv_cache_tokens=1024, page_size=8)
    yield engine
    assert_pool_idle(engine)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Reference greedy decoding by full recomputation (no KV cache, no EOS handling)."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_batched_chunked_greedy_matches_full_recompute(engine, hf_tiny):
    prompts = [prompt_of(n, seed=n) for n in (5, 23, 50, 1, 16)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    outputs = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"r{i}"]) == hf_greedy(hf_tiny, prompt, 12), f"prompt {i}"
        assert outputs[f"r{i}"][-1].finish_reason == "length"
        assert all(len(o.new_token_ids) == 1 for o in outputs[f"r{i}"])


def test_step_respects_token_budget_and_decodes_first(engine, monkeypatch):
    engine.add_request("short", prompt_of(3), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()  # "short" prefilled, now decoding
    engine.add_request("long", prompt_of(40), SamplingParams(max_tokens=2, ignore_eos=True))
    schedules = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        chunks = schedule()
        schedules.append([(c.seq.req_id, c.num_tokens) for c in chunks])
        return chunks

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    run_to_completion(engine)
    assert all(sum(n for _, n in step) <= 16 for step in schedules)
    assert schedules[:4] == [
        [("short", 1), ("long", 15)],
        [("short", 1), ("long", 15)],
        [("short", 1), ("long", 10)],
        [("short", 1), ("long", 1)],
    ], schedules[:4]


def test_stop_conditions(engine):
    prompt = prompt_of(7)
    engine.add_request("ref", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    reference = tokens_of(run_to_completion(engine)["ref"])
    end = reference[4]
    engine.add_request("end", prompt, SamplingParams(max_tokens=12, end_ids=(end,)))
    stop_seq = reference[5:7]
    engine.add_request("stopseq", prompt, SamplingParams(max_tokens=12, stop_token_ids=[stop_seq], ignore_eos=True))
    engine.add_request("max", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["end"]) == reference[: reference.index(end) + 1]
    assert outputs["end"][-1].finish_reason == "stop"
    got = tokens_of(outputs["stopseq"])
    assert got[-2:] == stop_seq and got == reference[: len(got)] and len(got) <= 7
    assert outputs["stopseq"][-1].finish_reason == "stop"
    assert tokens_of(outputs["max"]) == reference[:3] and outputs["max"][-1].finish_reason == "length"


def test_min_tokens_masks_end_ids_until_reached(engine):
    prompt = prompt_of(7)
    engine.add_request("ref", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    reference = tokens_of(run_to_completion(engine)["ref"])
    end = reference[0]  # greedy's first choice: ends the request at once without min_tokens
    engine.add_request("plain", prompt, SamplingParams(max_tokens=8, end_ids=(end,)))
    engine.add_request("min", prompt, SamplingParams(max_tokens=8, end_ids=(end,), min_tokens=5))
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["plain"]) == [end] and outputs["plain"][-1].finish_reason == "stop"
    got = tokens_of(outputs["min"])
    assert len(got) >= 5 and end not in got[:5], got  # never sampled before the minimum
    assert got[0] != end
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_max_model_len_ends_request(tiny_dir):
    engine = make_engine(tiny_dir, max_model_len=12, kv_cache_tokens=256)
    engine.add_request("a", prompt_of(9), SamplingParams(max_tokens=50, ignore_eos=True))
    outputs = run_to_completion(engine)["a"]
    assert len(tokens_of(outputs)) == 3 and outputs[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("b", prompt_of(12))
    assert_pool_idle(engine)


def test_abort_mid_prefill_and_mid_decode_frees_pages(engine):
    engine.add_request("decoding", prompt_of(4), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.add_request("prefilling", prompt_of(60), SamplingParams(max_tokens=5))
    engine.step()
    engine.step()
    assert engine.pool_stats()["used"] > 0
    prefilling = engine._seqs["prefilling"]
    assert 0 < prefilling.num_computed < prefilling.num_prompt_tokens
    out = engine.abort("prefilling")
    assert out.finished and out.finish_reason == "abort"
    assert engine._seqs["decoding"].num_output_tokens >= 1
    out = engine.abort("decoding")
    assert out.finish_reason == "abort" and engine.abort("decoding") is None
    assert_pool_idle(engine)


def test_abort_waiting_request(engine):
    engine.add_request("w", prompt_of(4))
    assert engine.abort("w").finish_reason == "abort"
    assert engine.step() == []


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.95, seed=7, ignore_eos=True)
    engine.add_request("a", prompt_of(6), params)
    alone = tokens_of(run_to_completion(engine)["a"])
    engine.add_request("other", prompt_of(30, seed=3), SamplingParams(max_tokens=9, temperature=0.8, seed=1))
    engine.add_request("a", prompt_of(6), params)
    engine.add_request(
        "b", prompt_of(6), SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.95, seed=8, ignore_eos=True)
    )
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["a"]) == alone
    assert tokens_of(outputs["b"]) != alone
    engine.add_request("g", prompt_of(6), SamplingParams(max_tokens=16, ignore_eos=True))
    assert tokens_of(run_to_completion(engine)["g"]) != alone  # sampling really is not greedy here


def test_request_waits_when_pool_cannot_commit(tiny_dir):
    engine = make_engine(tiny_dir, kv_cache_tokens=64, page_size=8, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request("a", prompt_of(20), params)  # commits 39 tokens = 5 of 8 pages
    engine.add_request("b", prompt_of(20, seed=1), params)
    engine.step()
    assert [s.req_id for s in engine.scheduler.running] == ["a"]
    assert [s.req_id for s in engine.scheduler.waiting] == ["b"]
    outputs = run_to_completion(engine)
    assert outputs["a"][-1].num_output_tokens == 20 and len(tokens_of(outputs["b"])) == 20
    assert_pool_idle(engine)


def test_invalid_requests_are_rejected_clearly(engine):
    with pytest.raises(ValueError, match="must not be empty"):
        engine.add_request("x", [])
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request("x", [1, TINY_VOCAB])
    with pytest.raises(ValueError, match="exceeds the limit"):
        engine.add_request("x", [5], SamplingParams(max_tokens=10_000))
    engine.add_request("x", [5])
    with pytest.raises(ValueError, match="already active"):
        engine.add_request("x", [6])
    engine.abort("x")


def test_request_larger_than_pool_is_rejected(tiny_dir):
    engine = make_engine(tiny_dir, kv_cache_tokens=32, page_size=8)
    with pytest.raises(ValueError, match="pool has 4"):
        engine.add_request("big", prompt_of(30), SamplingParams(max_tokens=10))


def test_exception_in_step_fails_its_requests_and_frees_pages(engine, monkeypatch):
    engine.add_request("a", prompt_of(5), SamplingParams(max_tokens=4))
    engine.add_request("b", prompt_of(9), SamplingParams(max_tokens=4))
    real_run = engine.runner.run

    def broken_run(*args, **kwargs):
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(engine.runner, "run", broken_run)
    outputs = engine.step()
    assert sorted(o.req_id for o in outputs) == ["a", "b"]
    assert all(o.finish_reason == "error" and "simulated device failure" in o.error for o in outputs)
    assert_pool_idle(engine)
    monkeypatch.setattr(engine.runner, "run", real_run)
    engine.add_request("c", prompt_of(5), SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(tokens_of(run_to_completion(engine)["c"])) == 4


def test_remote_kv_admission_is_the_scheduler_s(engine):
    """A remote-KV request is admitted like any other (pages, FIFO, commitments) and then waits
    for its KV holding its pages; a failure while it waits keeps them until release."""
    loader = RemoteLoader()
    engine.set_kv_loader(loader)
    pages = admit_remote(engine, "r", prompt_of(20), SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(pages) == 3 and loader.cached["r"] == 0 and engine.pool_stats()["used"] == 3
    assert not engine.has_work()  # waiting for remote KV is not work for the step loop
    with pytest.raises(ValueError, match="already active"):
        engine.add_request("r", prompt_of(21))
    with pytest.raises(ValueError, match="remote_kv and prefill_only"):
        engine.add_request("q", prompt_of(5), prefill_only=True, remote_kv=True)
    # the pool commits what each may grow into: a third big request waits in the queue, unparked
    big = SamplingParams(max_tokens=200, ignore_eos=True)
    admit_remote(engine, "big1", prompt_of(300), big)
    engine.add_request("big2", prompt_of(300), big, remote_kv=True)
    assert engine.step() == [] and engine.stalled()  # nothing can run until a command frees pages
    assert "big2" not in engine.scheduler.parked and engine.scheduler.waiting
    assert engine.abort("big2").finish_reason == "abort" and not engine.pool_stats()["committed"] == 0
    failed = engine.fail(["big1"], "no KV", ErrorKind.KV_TRANSFER_FAILED)
    assert failed[0].pages_held and engine.allocator.has("big1")  # a late write may still land
    assert not engine.kv_loaded("big1")  # ended: its KV arriving now changes nothing
    assert engine.release("big1") > 0 and not engine.allocator.has("big1")
    # the KV landed: it starts at its last prompt token
    assert engine.kv_loaded("r") and engine.scheduler.ready[0].num_computed == 19  # it takes a seat next step
    assert len(tokens_of(run_to_completion(engine)["r"])) == 4
    # a loader that keeps it here: the engine computes the prompt itself
    engine.set_kv_loader(RemoteLoader(remote=False))
    engine.add_request("local", prompt_of(20), SamplingParams(max_tokens=3, ignore_eos=True), remote_kv=True)
    assert len(tokens_of(run_to_completion(engine)["local"])) == 3
    engine.set_kv_loader(None)
