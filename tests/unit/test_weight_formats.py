"""Weight and KV formats of the engine (``weights_dtype``, ``kv_dtype``): int8 weights give the
output of transformers running the same int8 model, a bfloat16 KV cache under float32 weights
is really bfloat16 and stays close, bad combinations are refused by name, and two instances
whose KV formats differ cannot pair up (the fabric handshake's layout check)."""

from __future__ import annotations

import pytest
import torch

from backend.disagg.nixl_connector import kv_layout
from backend.engine.config import EngineConfig
from backend.engine.model_runner import quantize_linear_int8
from backend.engine.sampling_params import SamplingParams
from fabric_bridge.layout import LayoutMismatch, check_compatible
from tests.engine_helpers import assert_pool_idle, build_tiny_llama, make_engine, run_to_completion, tokens_of

PROMPT = [5, 17, 99, 3, 42, 7, 8, 120, 64, 33] * 10  # 100 tokens: two prefill chunks of 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-formats"))


def _hf_greedy_incremental(model, ids: list[int], n: int) -> list[int]:
    """transformers with its KV cache: the prompt in one forward, then one token per forward
    (dynamic int8 quantizes each forward's activations with their own range, so the reference
    must group tokens into forwards as the engine does)."""
    out, past, step = [], None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(n):
            res = model(step, cache=past, use_cache=True)
            past = res.cache
            out.append(int(res.logits[0, -1].argmax()))
            step = torch.tensor([[out[-1]]])
    return out


def test_int8_weights_equal_transformers_on_the_same_int8_model(tiny):
    from transformers import AutoModelForCausalLM

    engine = make_engine(tiny, weights_dtype="int8", max_num_batched_tokens=128)  # the prompt in one step
    linears = [m for m in engine.runner.model.modules() if type(m).__name__ == "Linear"]
    assert linears and all(m.__module__.startswith("torch.ao.nn.quantized.dynamic") for m in linears), linears[:2]
    assert engine.kv_cache().dtype == "float32"
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    got = tokens_of(run_to_completion(engine)["r"])
    assert_pool_idle(engine)
    reference = quantize_linear_int8(AutoModelForCausalLM.from_pretrained(str(tiny)).eval())
    assert got == _hf_greedy_incremental(reference, PROMPT, 12)


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
