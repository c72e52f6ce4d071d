"""Structured output in the engine: xgrammar bitmasks on the decode side, combined with
speculative decoding (drafts cut by the grammar, matcher advanced by emitted tokens only)."""

from __future__ import annotations

import json
import re

import pytest
from engine_helpers import assert_pool_idle, make_engine, real_model_dir, run_to_completion, tokens_of
from schema_check import PROMPTS, SCHEMAS, violations

from backend.engine.sampling.grammar import GrammarCompiler, GrammarError, GrammarState
from backend.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir():
    return real_model_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, 49152)


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(model_dir, max_num_batched_tokens=256)


def chat(tokenizer, text):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_invalid_grammars_are_refused_with_the_reason(compiler):
    with pytest.raises(GrammarError, match="invalid guided_json schema: .*JSON"):
        compiler.compile(json_schema='{"type": "object",')
    with pytest.raises(GrammarError, match="invalid guided_regex"):
        compiler.compile(regex="a[")
    with pytest.raises(GrammarError, match="exactly one"):
        compiler.compile(json_schema="{}", regex="a")


def test_drafts_are_cut_at_the_first_token_the_grammar_rejects(compiler, tokenizer):
    state = GrammarState(compiler.compile(regex="(yes|no), [0-9]+"))
    yes, comma, letters = (tokenizer.encode(t)[0] for t in ("yes", ",", "abc"))
    kept, bitmask = state.check_drafts([yes, comma, letters, yes])
    assert kept == [yes, comma] and bitmask.shape[0] == 3
    state.advance([yes])  # the matcher was rolled back: it accepts from the start again
    assert state.check_drafts([comma])[0] == [comma]


def test_regex_output_with_and_without_speculation(engine, compiler, tokenizer):
    grammar = compiler.compile(regex=r"The answer is (yes|no)\. Code: [A-Z]{3}-[0-9]{4}\.")
    prompt = chat(tokenizer, "Is Paris in France? Answer, then give a code like ABC-1234.")
    results = []
    for k in (0, 4):
        engine.add_request("r", prompt, SamplingParams(max_tokens=40, grammar=grammar, num_draft_tokens=k))
        out = run_to_completion(engine)["r"]
        results.append(tokens_of(out))
        assert out[-1].finish_reason == "stop"
    assert results[0] == results[1]
    text = tokenizer.decode(results[0], skip_special_tokens=True)
    assert re.fullmatch(r"The answer is (yes|no)\. Code: [A-Z]{3}-[0-9]{4}\.", text), text
    assert_pool_idle(engine)


def test_json_schema_outputs_validate_in_a_batch_with_speculation(engine, compiler, tokenizer):
    for i, (schema, text) in enumerate(zip(SCHEMAS[:3], PROMPTS)):
        grammar = compiler.compile(json_schema=json.dumps(schema))
        engine.add_request(
            f"j{i}", chat(tokenizer, text), SamplingParams(max_tokens=64, grammar=grammar, num_draft_tokens=3)
        )
    outs = run_to_completion(engine)
    for i, schema in enumerate(SCHEMAS[:3]):
        text = tokenizer.decode(tokens_of(outs[f"j{i}"]), skip_special_tokens=True)
        assert outs[f"j{i}"][-1].finish_reason == "stop", text
        assert violations(json.loads(text), schema) == [], text
    assert_pool_idle(engine)
