"""The lean layer loop against transformers' own modules on the real checkpoint under int8
weights: equal hidden states bit for bit (the tiny-model checks are in ``tests/unit``)."""

from __future__ import annotations

import torch

from backend.engine.config import EngineConfig
from backend.engine.model_runner import ModelRunner
from backend.engine.paged_attention import BatchEntry
from tests.engine_helpers import real_model_dir

PROMPTS = [[5, 17, 42, 9, 77, 3, 120, 64, 8, 31, 200, 11], [7, 7, 99, 150, 1, 33]]


def _runner(tiny, **kw) -> ModelRunner:
    kw.setdefault("weights_dtype", "float32")  # the comparisons are float32's unless a test names a format
    return ModelRunner(EngineConfig(model_path=str(tiny), kv_cache_tokens=512, **kw))


def _step_states(runner: ModelRunner) -> torch.Tensor:
    """Hidden states of a mixed step: a 12-token prefill and a 6-token one that fill the pool,
    then a step of two decodes and a continued prefill chunk that attend over it."""
    runner.run([BatchEntry(PROMPTS[0], 0, [0]), BatchEntry(PROMPTS[1], 0, [1])])
    mixed = [BatchEntry([4], 12, [0]), BatchEntry([9, 10, 11], 6, [1]), BatchEntry([200], 0, [2])]
    return runner.run(mixed).hidden


def test_lean_loop_equals_transformers_modules_on_the_real_checkpoint_under_int8():
    """Bit for bit on SmolLM2-135M too (the residual stream rotated, activations quantized per
    row): its 30 layers amplify a one-ulp difference (e.g. a fused multiply-add in the rotary
    embedding) through the activations' int8 quantization."""
    model = real_model_dir()
    states = [_step_states(_runner(model, weights_dtype="int8", decoder=d)) for d in ("auto", "transformers")]
    assert torch.equal(*states), (states[0] - states[1]).abs().max().item()
