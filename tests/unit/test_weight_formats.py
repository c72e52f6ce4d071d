"""Weight and KV formats of the engine (``weights_dtype``, ``kv_dtype``): int8 weights give the
output of transformers running the same int8 model, whatever the chunking of the prompt (the
activations are quantized per row), a bfloat16 KV cache under float32 weights
is really bfloat16 and stays close, bad combinations are refused by name, and two instances
whose KV formats differ cannot pair up (the fabric handshake's layout check)."""

from __future__ import annotations

import pytest
import torch

from backend.disagg.nixl_connector import kv_layout
from backend.engine.config import EngineConfig
from backend.engine.int8_linear import Int8Linear, full_range_is_exact, rotate_residual_stream
from backend.engine.model_runner import quantize_linear_int8
from backend.engine.sampling_params import SamplingParams
from fabric_bridge.layout import LayoutMismatch, check_compatible
from tests.engine_helpers import assert_pool_idle, build_tiny_llama, make_engine, run_to_completion, tokens_of

PROMPT = [5, 17, 99, 3, 42, 7, 8, 120, 64, 33] * 10  # 100 tokens: two prefill chunks of 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-formats"))


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers with its KV cache: the prompt in one forward, then one token per forward."""
    out, past, step = [], None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(n):
            res = model(step, cache=past, use_cache=True)
            past = res.cache
            out.append(int(res.logits[0, -1].argmax()))
            step = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize("decoder", ["auto", "transformers"])
def test_int8_weights_equal_transformers_on_the_same_int8_model(tiny, decoder):
    """The engine prefills the prompt in two chunks of 64 (through the lean loop or transformers'
    modules), transformers in one forward: the same tokens, since each token's activations are
    quantized with their own scale."""
    from transformers import AutoModelForCausalLM

    engine = make_engine(tiny, weights_dtype="int8", decoder=decoder)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, (torch.nn.Linear, Int8Linear))]
    assert linears and all(isinstance(m, Int8Linear) for m in linears), linears[:2]
    assert engine.kv_cache().dtype == "float32"
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    got = tokens_of(run_to_completion(engine)["r"])
    assert_pool_idle(engine)
    reference = quantize_linear_int8(AutoModelForCausalLM.from_pretrained(str(tiny)).eval())
    assert got == _hf_greedy(reference, PROMPT, 12)


def test_int8_rows_do_not_depend_on_the_other_rows():
    """Per-row activation scales: a row's product is the same bits alone, in any batch, and next
    to a row with outliers 1000x larger (one scale per tensor rounds this row to a few levels)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40)
    q = Int8Linear(linear)
    x = torch.randn(6, 96)
    x[0] *= 1000.0
    x[3, 7] = 300.0  # an outlier feature inside one row
    with torch.inference_mode():
        together = q(x)
        for i in range(6):
            assert torch.equal(q(x[i : i + 1]), together[i : i + 1])
        assert torch.equal(q(x[None, 2:5]), together[None, 2:5])  # any leading shape
        exact = linear(x)
    error = (together - exact).norm(dim=1) / exact.norm(dim=1)
    assert error.max() < 0.03, error
    assert full_range_is_exact() == (q.quant[1] == 128)


def test_rotating_the_residual_stream_keeps_the_float_model(tiny):
    """int8's rotation alone (float weights): the same logits and final hidden states, to float
    rounding, though every weight that touches the stream changed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny)).eval()
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        before = model(ids, output_hidden_states=True)
        embedding = model.model.embed_tokens.weight.clone()
        rotate_residual_stream(model)
        after = model(ids, output_hidden_states=True)
    assert not torch.allclose(model.model.embed_tokens.weight, embedding, atol=1e-3)
    assert not torch.allclose(after.hidden_states[1], before.hidden_states[1], atol=1e-3)  # the stream: rotated
    torch.testing.assert_close(after.logits, before.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after.hidden_states[-1], before.hidden_states[-1], atol=1e-5, rtol=1e-4)


def test_int8_prefill_logits_do_not_depend_on_the_chunking(tiny):
    """The same prompt prefilled in chunks of 64, 32 and 100 tokens: the same last-position logits
    bit for bit (with one activation scale per step they differed with the chunking)."""
    logits = [_prefill_logits(make_engine(tiny, weights_dtype="int8", max_num_batched_tokens=n)) for n in (64, 32, 100)]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


def _prefill_logits(engine) -> torch.Tensor:
    engine.add_request("p", PROMPT, SamplingParams(max_tokens=1), prefill_only=True)
    (out,) = [o for o in run_to_completion(engine)["p"] if o.finished]
    engine.release("p")
    return out.logits.float()


def test_bfloat16_kv_under_float32_weights(tiny):
    fp32 = make_engine(tiny)
    bf16_kv = make_engine(tiny, kv_dtype="bfloat16")
    assert bf16_kv.kv_cache().dtype == "bfloat16" and bf16_kv.kv_cache().shards[0].dtype == torch.bfloat16
    assert bf16_kv.runner.model.lm_head.weight.dtype == torch.float32
    a, b = _prefill_logits(fp32), _prefill_logits(bf16_kv)  # the second chunk attends over the pool
    assert not torch.equal(a, b)  # the pool really rounds to bfloat16
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.999
    assert int(a.argmax()) == int(b.argmax())


def test_formats_are_checked_by_name(tiny):
    with pytest.raises(ValueError, match="weights_dtype"):
        EngineConfig(model_path=str(tiny), weights_dtype="int4")
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig(model_path=str(tiny), kv_dtype="int8")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model_path=str(tiny), weights_dtype="int8", tensor_parallel_size=2)
    assert EngineConfig(model_path=str(tiny), dtype="bfloat16").kv_format == "bfloat16"
    assert EngineConfig(model_path=str(tiny), weights_dtype="int8").torch_dtype == torch.float32


def test_peers_with_other_formats_refuse_each_other(tiny):
    base = kv_layout(make_engine(tiny).kv_cache())
    with pytest.raises(LayoutMismatch, match="model: 'tiny-formats.*\\+float32' vs '.*\\+int8'"):
        check_compatible(base, kv_layout(make_engine(tiny, weights_dtype="int8").kv_cache()))
    with pytest.raises(LayoutMismatch, match="dtype: 'float32' vs 'bfloat16'"):
        check_compatible(base, kv_layout(make_engine(tiny, kv_dtype="bfloat16").kv_cache()))
    check_compatible(base, kv_layout(make_engine(tiny, weights_dtype="float32").kv_cache()))
