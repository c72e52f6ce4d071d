"""The lean layer loop (``backend/engine/lean_decoder.py``) against transformers' own modules on
the same checkpoint: equal hidden states (to float32 rounding), equal greedy tokens,
and the fallback to transformers' modules for layers it does not fit."""

from __future__ import annotations

import pytest
import torch

from backend.engine.config import EngineConfig
from backend.engine.lean_decoder import unsupported_reason
from backend.engine.model_runner import ModelRunner
from backend.engine.protocol import BatchEntry
from backend.engine.sampling_params import SamplingParams
from tests.engine_helpers import build_tiny_llama, make_engine, run_to_completion, tokens_of

PROMPTS = [[5, 17, 42, 9, 77, 3, 120, 64, 8, 31, 200, 11], [7, 7, 99, 150, 1, 33]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-lean"))


def _runner(tiny, **kw) -> ModelRunner:
    kw.setdefault("weights_dtype", "float32")  # the comparisons are float32's unless a test names a format
    return ModelRunner(EngineConfig(model_path=str(tiny), kv_cache_tokens=512, **kw))


def _step_states(runner: ModelRunner) -> torch.Tensor:
    """Hidden states of a mixed step: a 12-token prefill and a 6-token one that fill the pool,
    then a step of two decodes and a continued prefill chunk that attend over it."""
    runner.run([BatchEntry(PROMPTS[0], 0, [0]), BatchEntry(PROMPTS[1], 0, [1])])
    mixed = [BatchEntry([4], 12, [0]), BatchEntry([9, 10, 11], 6, [1]), BatchEntry([200], 0, [2])]
    return runner.run(mixed).hidden


def test_lean_loop_equals_transformers_modules(tiny):
    lean = _runner(tiny, weights_dtype="float32", decoder="lean")
    reference = _runner(tiny, weights_dtype="float32", decoder="transformers")
    assert lean.decoder == "lean" and reference.decoder == "transformers"
    assert not hasattr(lean.model.model.layers[0].self_attn, "q_proj")  # the weights are held once
    a, b = _step_states(lean), _step_states(reference)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # the fused products may sum in another order


def test_lean_loop_greedy_tokens_equal_transformers_modules(tiny):
    got = {}
    for decoder in ("auto", "transformers"):
        engine = make_engine(tiny, decoder=decoder)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
        outs = run_to_completion(engine)
        got[decoder] = [tokens_of(outs[f"r{i}"]) for i in range(len(PROMPTS))]
    assert got["auto"] == got["transformers"] and all(len(t) == 16 for t in got["auto"])


def test_layers_the_loop_does_not_fit_run_through_transformers(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny))
    assert unsupported_reason(model) is None
    gelu = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "hidden_act": "gelu"}))
    assert "activation 'gelu'" in unsupported_reason(gelu)
    biased = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "attention_bias": True}))
    assert unsupported_reason(biased) is None  # a bias is fused with its weights
    gelu.save_pretrained(tmp_path / "gelu")
    runner = ModelRunner(EngineConfig(model_path=str(tmp_path / "gelu"), kv_cache_tokens=512))
    assert runner.decoder == "transformers"
    assert runner.run([BatchEntry(PROMPTS[1], 0, [0])]).logits.shape == (1, model.config.vocab_size)


def test_decoder_setting_is_checked_by_name(tiny):
    with pytest.raises(ValueError, match="EngineConfig.decoder must be one of"):
        EngineConfig(model_path=str(tiny), decoder="fast")
