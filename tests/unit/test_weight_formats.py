"""Weight and KV formats of the engine (``weights_dtype``, ``kv_dtype``): a bfloat16 KV cache
under float32 weights is really bfloat16 and stays close, bad combinations are refused by name,
and two instances whose KV formats differ cannot pair up (the fabric handshake's layout check)."""

from __future__ import annotations

import pytest
import torch

from backend.disagg.nixl_connector import kv_layout
from backend.engine.config import EngineConfig
from backend.engine.sampling_params import SamplingParams
from fabric_bridge.layout import LayoutMismatch, check_compatible
from tests.engine_helpers import build_tiny_llama, make_engine, run_to_completion

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


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got.double() - want.double()).norm(dim=-1) / want.double().norm(dim=-1)


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
        EngineConfig(model_path=str(tiny), weights_dtype="fp16w", tensor_parallel_size=2)
    assert EngineConfig(model_path=str(tiny), dtype="bfloat16").kv_format == "bfloat16"
    assert EngineConfig(model_path=str(tiny), weights_dtype="fp16w").torch_dtype == torch.float32


def test_peers_with_other_formats_refuse_each_other(tiny):
    base = kv_layout(make_engine(tiny).kv_cache())
    with pytest.raises(LayoutMismatch, match="model: 'tiny-formats.*\\+float32' vs '.*\\+fp16w'"):
        check_compatible(base, kv_layout(make_engine(tiny, weights_dtype="fp16w", kv_dtype="float32").kv_cache()))
    with pytest.raises(LayoutMismatch, match="dtype: 'float32' vs 'bfloat16'"):
        check_compatible(base, kv_layout(make_engine(tiny, kv_dtype="bfloat16").kv_cache()))
    check_compatible(base, kv_layout(make_engine(tiny, weights_dtype="float32").kv_cache()))
