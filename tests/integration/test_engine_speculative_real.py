"""Speculative decoding on the real checkpoint: greedy outputs token-for-token those of plain
decoding (aggregated and decode role, batched, with stop conditions), with rejected drafts rolled
back (num_computed and pages). The drafters and the verification rule are unit-tested."""

from __future__ import annotations

import collections

import pytest
import torch
from engine_helpers import admit_remote, assert_pool_idle, make_engine, real_model_dir, run_to_completion, tokens_of

from backend.engine.outputs import FinishReason
from backend.engine.sampling_params import SamplingParams

COPY_PROMPT = (
    "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n"
    "Rewrite the code above, renaming w to width:\n"
)


# --- units ---------------------------------------------------------------------------------------


# --- real model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir():
    return real_model_dir()


@pytest.fixture(scope="module")
def prompts(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = [
        COPY_PROMPT,
        "Name: Ada Lovelace\nBorn: 1815\nField: mathematics\nRepeat the record.\nName:",
        "The capital of France is",
        "List three fruits:",
    ]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(model_dir, max_num_batched_tokens=128)


def generate(engine, prompts, params: SamplingParams, check_pages: bool = False):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs = collections.defaultdict(list)
    while engine.has_work():
        for out in engine.step():
            outputs[out.req_id].append(out)
        if check_pages:  # rejected drafts never keep pages past the tokens the sequence holds
            for seq in engine._seqs.values():
                held = len(engine.allocator.page_table(seq.req_id))
                assert held <= engine.allocator.pages_for(seq.num_tokens)
                assert seq.num_computed == seq.num_tokens - 1 or seq.num_computed < seq.num_prompt_tokens
    assert_pool_idle(engine)
    return [outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def plain(engine, prompts):
    return [tokens_of(o) for o in generate(engine, prompts, SamplingParams(max_tokens=24, ignore_eos=True))]


@pytest.mark.parametrize("method", ["lookup", "hidden"])
def test_aggregated_greedy_identical_with_speculation(engine, prompts, plain, method):
    params = SamplingParams(max_tokens=24, ignore_eos=True, num_draft_tokens=4, draft_method=method)
    outs = generate(engine, prompts, params, check_pages=True)
    assert [tokens_of(o) for o in outs] == plain
    steps = sum(len(o) for o in outs)
    if method == "lookup":  # the copy prompt lets lookup accept drafts: fewer steps than tokens
        assert len(outs[0]) < 24, [len(o) for o in outs]
    assert all(len(o) <= 24 for o in outs) and steps <= 4 * 24


def test_max_tokens_and_stop_ids_within_accepted_drafts(engine, prompts, plain):
    short = generate(engine, prompts, SamplingParams(max_tokens=5, ignore_eos=True, num_draft_tokens=8))
    assert [tokens_of(o) for o in short] == [p[:5] for p in plain]
    stop_id = plain[0][6]  # stop on a token the copy prompt's output emits mid-stream
    want = plain[0][: plain[0].index(stop_id) + 1]
    outs = generate(engine, prompts[:1], SamplingParams(max_tokens=24, end_ids=(stop_id,), num_draft_tokens=8))
    assert tokens_of(outs[0]) == want and outs[0][-1].finish_reason == "stop"


def test_sampling_with_speculation_runs_to_max_tokens(engine, prompts):
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_k=40, seed=3, num_draft_tokens=4)
    outs = generate(engine, prompts, params, check_pages=True)
    assert all(len(tokens_of(o)) == 16 and o[-1].finish_reason == "length" for o in outs)


def test_decode_role_with_transferred_hidden_state_identical(model_dir, prompts, plain):
    """Prefill engine -> pages copied into the decode engine's reserved pages; the decode engine
    speculates from the first step, the hidden drafter fed the transferred hidden state/logits."""
    prefill = make_engine(model_dir, max_num_batched_tokens=128)
    decode = make_engine(model_dir, max_num_batched_tokens=128)
    page_size = prefill.config.page_size
    for method in ("lookup", "hidden"):
        for i, prompt in enumerate(prompts):
            prefill.add_request(f"r{i}", prompt[:-1], prefill_only=True)
        done = run_to_completion(prefill)
        params = SamplingParams(max_tokens=24, ignore_eos=True, num_draft_tokens=4, draft_method=method)
        dsts = [admit_remote(decode, f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]
        for i, prompt in enumerate(prompts):
            out = done[f"r{i}"][-1]
            assert out.finish_reason == FinishReason.PREFILL_DONE
            dst = dsts[i]
            src = prefill.allocator.page_table(f"r{i}")
            for layer in range(prefill.runner.hf_config.num_hidden_layers):
                for s, d in zip(src, dst[: -(-(len(prompt) - 1) // page_size)]):
                    decode.pool.layer(layer)[d].copy_(prefill.pool.layer(layer)[s])
            prefill.release(f"r{i}")
            assert decode.kv_loaded(f"r{i}", out.hidden_state.float(), out.logits.float())
            assert torch.equal(decode._seqs[f"r{i}"].last_logits, out.logits.float())
        outs = run_to_completion(decode)
        assert [tokens_of(outs[f"r{i}"]) for i in range(len(prompts))] == plain, method
        assert_pool_idle(decode)
