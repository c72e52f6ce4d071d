"""Decode steps as one kernel call (``backend/engine/fused_decode.py``; int4w's 4-bit groups,
float32 and fp16w's float16 weights) against the lean layer loop on the same weights: the same
greedy tokens for a batch of sequences of different lengths, the same final hidden states and the
same K/V in the pool (within float32 rounding; float16's for a float16 pool), and the steps it does
not take (a prefill chunk, a per-layer hook, more than 16 sequences, a pool neither float32 nor
float16). On both kernel paths where the CPU has them (the ``kernels`` fixture). The real
checkpoint's quality through it: ``tests/integration/test_int4w_quality.py``; float32's greedy
tokens against transformers': ``tests/integration/test_lean_decoder_real.py``."""

from __future__ import annotations

import re

import pytest
import torch

from backend.engine.fused_decode import FusedDecode
from backend.engine.paged_attention import build_paged_batch
from backend.engine.protocol import BatchEntry
from backend.engine.sampling_params import SamplingParams
from tests.engine_helpers import (
    assert_pool_idle,
    build_tiny_llama,
    make_engine,
    prompt_of,
    run_to_completion,
    tokens_of,
)

PROMPTS = [prompt_of(n, seed=n) for n in (5, 17, 40)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-fused"))


FORMATS = pytest.mark.parametrize("fmt", ["int4w", "float32", "fp16w"])


def engines(tiny, fmt="int4w", kv_dtype=""):
    fused = make_engine(tiny, weights_dtype=fmt, kv_dtype=kv_dtype)
    lean = make_engine(tiny, weights_dtype=fmt, kv_dtype=kv_dtype, decoder="lean")
    assert fused.runner.decoder == "lean+fused" and isinstance(fused.runner._fused, FusedDecode)
    assert lean.runner.decoder == "lean" and lean.runner._fused is None
    return fused, lean


def greedy_tokens(engine, max_tokens: int) -> dict:
    """PROMPTS' greedy tokens through ``engine``, by request."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return {k: tokens_of(v) for k, v in run_to_completion(engine).items()}


@FORMATS
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_fused_steps_give_the_lean_loops_tokens_hidden_states_and_kv(tiny, kernels, fmt, kv_dtype):
    fused, lean = engines(tiny, fmt, kv_dtype)
    assert fused.runner.pool.dtype == getattr(torch, kv_dtype)
    assert greedy_tokens(fused, 24) == greedy_tokens(lean, 24)
    assert_pool_idle(fused)
    assert_pool_idle(lean)
    # one decode step of three sequences, straight through the runners on equal pools
    entries = [
        BatchEntry([7 + i], start=len(p), page_table=list(range(4 * i, 4 * i + 4))) for i, p in enumerate(PROMPTS)
    ]
    torch.manual_seed(0)
    fused.runner.pool.tensor.copy_(torch.randn_like(fused.runner.pool.tensor))
    lean.runner.pool.tensor.copy_(fused.runner.pool.tensor)
    a, b = fused.runner.run(entries), lean.runner.run(entries)
    # float32's rounding through 2 layers over random K/V (softmax, norms and sums in another order,
    # e^x within 1.3 ulp): 0.5e-4 to 2e-4 on these unit-scale hidden states; a wrong page, position
    # or head would be off by units. A float16 pool: both read the same float16 K/V; the step's new
    # K/V, equal within float32's rounding before, may round to neighbouring float16 values (1e-3)
    tol = 5e-4 if kv_dtype == "float32" else 2e-3
    assert torch.allclose(a.hidden, b.hidden, rtol=tol, atol=tol), (a.hidden - b.hidden).abs().max()
    assert torch.allclose(a.logits, b.logits, rtol=tol, atol=4 * tol)
    diff = (fused.runner.pool.tensor.float() - lean.runner.pool.tensor.float()).abs().max()
    print("largest K/V difference", float(diff), "hidden", float((a.hidden - b.hidden).abs().max()))
    kv_tol = 1e-4 if kv_dtype == "float32" else 2e-3
    assert torch.allclose(fused.runner.pool.tensor, lean.runner.pool.tensor, rtol=kv_tol, atol=kv_tol), diff


def test_rotary_rows_come_from_the_table_up_to_its_end_and_are_computed_past_it(tiny, monkeypatch):
    """The step's rotary cos and sin: rows of the table made at load (each equal, bit for bit, to
    what the model's rotary module gives for that position alone), and computed beyond the
    table's last position, with the same tokens as the lean loop either way."""
    from backend.engine import fused_decode
    from backend.engine.lean_decoder import rotary

    monkeypatch.setattr(fused_decode, "ROPE_TABLE_POSITIONS", 48)  # the prompts run past it
    fused, lean = engines(tiny, "float32")
    steps = fused.runner._fused
    cos, sin = steps._rope_table
    assert cos.shape[0] == 48 == sin.shape[0]
    inner = fused.runner.model.model
    for p in (0, 5, 47):
        one_cos, one_sin = rotary(inner, torch.zeros(1, 1, 1), torch.tensor([[p]]))
        assert torch.equal(cos[p], one_cos[0]) and torch.equal(sin[p], one_sin[0])
    computed, steps_taken = [], []
    real, rows = fused_decode.rotary, steps._cos_sin
    monkeypatch.setattr(fused_decode, "rotary", lambda *a: computed.append(1) or real(*a))
    monkeypatch.setattr(steps, "_cos_sin", lambda *a: steps_taken.append(1) or rows(*a))
    assert greedy_tokens(fused, 12) == greedy_tokens(lean, 12)
    assert 0 < len(computed) < len(steps_taken), (len(computed), len(steps_taken))  # past 47 only


@FORMATS
def test_steps_it_does_not_take_run_the_lean_loop(tiny, kernels, fmt):
    fused, _ = engines(tiny, fmt)
    runner, steps = fused.runner, fused.runner._fused
    pool = runner.pool

    def batch(lengths):
        entries = [BatchEntry([5] * n, start=3, page_table=[i]) for i, n in enumerate(lengths)]
        return build_paged_batch(entries, pool, torch.device("cpu"))

    assert steps.forward(batch([1] * 16)) is not None
    assert steps.forward(batch([1] * 17)) is None  # more than 16 sequences
    assert steps.forward(batch([1, 4])) is None  # a prefill chunk in the step
    hooked = batch([1])
    hooked.on_layer_kv_written = lambda layer, arg: None
    assert steps.forward(hooked) is None  # a listener per layer (layer-wise KV streaming)


@FORMATS
def test_a_pool_neither_float32_nor_float16_keeps_the_lean_loop(tiny, fmt):
    engine = make_engine(tiny, weights_dtype=fmt, kv_dtype="bfloat16")
    assert engine.runner.decoder == "lean" and engine.runner._fused is None


@pytest.mark.parametrize("fmt", ["bfloat16"])
def test_other_formats_keep_the_lean_loop(tiny, fmt):
    engine = make_engine(tiny, weights_dtype=fmt)
    assert engine.runner.decoder == "lean" and engine.runner._fused is None


@FORMATS
def test_fused_steps_on_two_threads_equal_one_threads(tiny, kernels, fmt):
    one = make_engine(tiny, weights_dtype=fmt, num_threads=1)
    two = make_engine(tiny, weights_dtype=fmt, num_threads=2)
    assert one.runner._fused.threads == 1 and two.runner._fused.threads == 2
    assert greedy_tokens(one, 16) == greedy_tokens(two, 16)


@pytest.mark.parametrize("fmt", ["float32", "fp16w"])
def test_without_the_kernel_library_float_formats_run_torchs_kernels(tiny, fmt, tmp_path, monkeypatch, caplog):
    """No C compiler (the library cannot be built): float32 and fp16w still serve, through the lean
    loop and torch's (fbgemm's) products, with one log line that says why; same greedy tokens."""
    from backend.engine import group_matmul
    from backend.engine.fp16_linear import Fp16Linear
    from backend.engine.small_batch_linear import SmallBatchLinear

    want = {}
    engine = make_engine(tiny, weights_dtype=fmt)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    want = {k: tokens_of(v) for k, v in run_to_completion(engine).items()}
    monkeypatch.setenv("TRITON_DISAGG_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    for cached in (group_matmul.library, group_matmul.kernel, group_matmul.f32_unsupported):
        cached.cache_clear()
    try:
        with caplog.at_level("INFO", logger="triton_disagg.engine"):
            engine = make_engine(tiny, weights_dtype=fmt)
        assert engine.runner.decoder == "lean" and engine.runner._fused is None
        assert re.search(r"group kernels: compiling \w+\.c failed", caplog.text), caplog.text
        modules = list(engine.runner.model.modules())
        assert not any(isinstance(m, SmallBatchLinear) for m in modules)
        assert all(m.half_weight is None for m in modules if isinstance(m, Fp16Linear))
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        assert {k: tokens_of(v) for k, v in run_to_completion(engine).items()} == want
        assert_pool_idle(engine)
    finally:
        for cached in (group_matmul.library, group_matmul.kernel, group_matmul.f32_unsupported):
            cached.cache_clear()
