"""The engine against transformers on the real SmolLM2-135M-Instruct checkpoint (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_pool_idle, make_engine, real_model_dir, run_to_completion, tokens_of

from backend.engine.protocol import BatchEntry
from backend.engine.sampling_params import SamplingParams

NEW_TOKENS = 20
LOGIT_TOLERANCE = 1e-3
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to cook.",
    "Explain what a CPU cache is in two sentences.",
]
PLAIN_PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker who",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 5, 8, 13,",
]


@pytest.fixture(scope="module")
def model_dir():
    return real_model_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine_module(model_dir):
    return make_engine(model_dir, max_num_batched_tokens=32)


@pytest.fixture
def engine(engine_module):
    yield engine_module
    assert_pool_idle(engine_module)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    chat = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for p in CHAT_PROMPTS
    ]
    plain = [tokenizer(p)["input_ids"] for p in PLAIN_PROMPTS]
    return chat + plain


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts):
    with torch.inference_mode():
        return [
            hf_model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )[0, len(p) :].tolist()
            for p in prompts
        ]


def test_greedy_matches_transformers_generate_batched_and_chunked(engine, prompts, hf_greedy, tokenizer):
    """8 prompts (4 chat, 4 plain, 5..40 tokens) at once with a 32-token step budget: prefills are
    chunked over several steps and mixed with other requests' decodes."""
    lengths = sorted(len(p) for p in prompts)
    assert lengths[-1] > 32 and lengths[0] < 16, lengths
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=NEW_TOKENS))
    outputs = run_to_completion(engine)
    for i, expected in enumerate(hf_greedy):
        got = tokens_of(outputs[f"r{i}"])
        assert got == expected, f"prompt {i}: {tokenizer.decode(got)!r} != {tokenizer.decode(expected)!r}"
        assert outputs[f"r{i}"][-1].finish_reason == ("stop" if expected[-1] in engine.default_end_ids else "length")
    assert "Paris" in tokenizer.decode(tokens_of(outputs["r0"]))


def test_greedy_one_at_a_time_matches(engine, prompts, hf_greedy):
    for i in (1, 5):
        engine.add_request("solo", prompts[i], SamplingParams(max_tokens=NEW_TOKENS))
        assert tokens_of(run_to_completion(engine)["solo"]) == hf_greedy[i]


def test_logits_match_transformers_forward(engine, hf_model, prompts):
    """Last-position logits of a chunked prefill and of decode steps vs one full transformers forward."""
    prompt = prompts[5]
    with torch.inference_mode():
        reference = hf_model(torch.tensor([prompt])).logits[0]
    engine.add_request("pf", prompt[:-3], prefill_only=True)
    outputs = run_to_completion(engine)
    diff = (outputs["pf"][-1].logits - reference[len(prompt) - 4]).abs().max().item()
    assert diff < LOGIT_TOLERANCE, diff
    engine.release("pf")
    # decode-path logits: the runner directly, a prefill then three single-token steps in reserved pages
    pages = engine.allocator.allocate("dec", len(prompt))
    result = engine.runner.run([BatchEntry(prompt[:-3], 0, pages)])
    for pos in range(len(prompt) - 3, len(prompt)):
        result = engine.runner.run([BatchEntry([prompt[pos]], pos, pages)])
        diff = (result.logits[0] - reference[pos]).abs().max().item()
        assert diff < LOGIT_TOLERANCE, (pos, diff)
    engine.allocator.free("dec")
