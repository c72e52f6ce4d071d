"""Log-probabilities from the engine on a tiny random Llama: output tokens' and the prompt's,
against a full forward of transformers on the same checkpoint, through chunked prefill, batching,
a cached prefix (which a scoring request must not reuse) and speculative decoding (refused)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_pool_idle, build_tiny_llama, make_engine, prompt_of, run_to_completion, tokens_of

from backend.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama_lp"))


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture
def engine(tiny_dir):
    engine = make_engine(tiny_dir, max_num_batched_tokens=16, kv_cache_tokens=1024, page_size=8)
    yield engine
    assert_pool_idle(engine)


def reference(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of ``tokens`` [len, vocab]."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def test_prompt_and_output_logprobs_equal_a_full_forward(engine, hf_tiny):
    prompts = {"long": prompt_of(45, 1), "short": prompt_of(7, 2), "one": prompt_of(1, 3)}
    for name, prompt in prompts.items():  # batched together; the long one is prefilled in 3 chunks
        engine.add_request(name, prompt, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2))
    outputs = run_to_completion(engine)
    for name, prompt in prompts.items():
        outs = outputs[name]
        tokens = prompt + tokens_of(outs)
        ref = reference(hf_tiny, tokens)
        first = outs[0].prompt_logprobs
        assert first is not None and all(o.prompt_logprobs is None for o in outs[1:])
        assert len(first) == len(prompt) - 1
        expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
        torch.testing.assert_close(first.logprobs, expected, atol=1e-4, rtol=0)
        top = ref[: len(prompt) - 1].topk(2, dim=-1)
        torch.testing.assert_close(first.top_logprobs, top.values, atol=1e-4, rtol=0)
        assert first.top_ids.shape == (len(prompt) - 1, 2)
        # output tokens: one log-prob each, greedy: equal to the top-1 value exactly
        lps = torch.cat([o.logprobs.logprobs for o in outs])
        pos = torch.arange(len(prompt) - 1, len(tokens) - 1)
        torch.testing.assert_close(lps, ref[pos, torch.tensor(tokens[len(prompt) :])], atol=1e-4, rtol=0)
        for o in outs:
            assert len(o.logprobs) == len(o.new_token_ids)
            assert o.logprobs.top_ids[:, 0].tolist() == o.new_token_ids
            assert torch.equal(o.logprobs.top_logprobs[:, 0], o.logprobs.logprobs)


def test_a_scoring_request_computes_its_whole_prompt_despite_a_cached_prefix(engine, hf_tiny):
    prompt = prompt_of(40, 5)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    run_to_completion(engine)
    assert engine.pool_stats()["cached"] > 0
    hits = engine.pool_stats()["prefix_hit_tokens"]
    engine.add_request("score", prompt, SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=0))
    out = run_to_completion(engine)["score"][0]
    assert engine.pool_stats()["prefix_hit_tokens"] == hits  # nothing of the cached prefix reused
    ref = reference(hf_tiny, prompt)
    expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
    torch.testing.assert_close(out.prompt_logprobs.logprobs, expected, atol=1e-4, rtol=0)
    assert out.prompt_logprobs.top_ids.shape == (len(prompt) - 1, 0)


def test_logprobs_are_of_the_raw_distribution_under_sampling(engine, hf_tiny):
    prompt = prompt_of(12, 7)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.7, top_k=5, seed=3, logprobs=0)
    engine.add_request("s", prompt, params)
    outs = run_to_completion(engine)["s"]
    tokens = prompt + tokens_of(outs)
    ref = reference(hf_tiny, tokens)
    lps = torch.cat([o.logprobs.logprobs for o in outs])
    pos = torch.arange(len(prompt) - 1, len(tokens) - 1)
    torch.testing.assert_close(lps, ref[pos, torch.tensor(tokens[len(prompt) :])], atol=1e-4, rtol=0)


def test_logprobs_with_draft_tokens_or_out_of_range_are_refused():
    with pytest.raises(ValueError, match="speculative decoding"):
        SamplingParams(logprobs=1, num_draft_tokens=2)
    with pytest.raises(ValueError, match="speculative decoding"):
        SamplingParams(prompt_logprobs=0, num_draft_tokens=2)
    with pytest.raises(ValueError, match=r"logprobs must be None or in \[0, 20\]"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None or in \[0, 20\]"):
        SamplingParams(prompt_logprobs=-1)
