"""``weights_dtype=fp16w``: the engine's greedy tokens are transformers' on the same model with its
linear weights rounded to float16 (float32 compute), through both decoders; an fp16w product is
the float32 product with float16-rounded weights whatever the number of rows; the format is
refused by name on a CPU without the features fbgemm's kernel needs and with tensor parallelism."""

from __future__ import annotations

import pytest
import torch

from backend.engine import cpu_kernels
from backend.engine.config import EngineConfig
from backend.engine.cpu_kernels import kernel_path
from backend.engine.fp16_linear import Fp16Linear, quantize_linear_fp16
from backend.engine.sampling_params import SamplingParams
from backend.engine.small_batch_linear import SmallBatchLinear
from tests.engine_helpers import assert_pool_idle, build_tiny_llama, make_engine, run_to_completion, tokens_of
from tests.unit.test_weight_formats import PROMPT, _hf_greedy, _relative_error


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-fp16w"))


def _rounded_to_fp16(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every linear layer's weight rounded to float16 and back (float32 compute)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):  # a new parameter: unties a tied LM head from the embedding
                m.weight = torch.nn.Parameter(m.weight.half().float(), requires_grad=False)
    return model


@pytest.mark.parametrize("decoder", ["auto", "transformers"])
def test_fp16w_tokens_equal_transformers_on_fp16_rounded_weights(tiny, decoder):
    """The prompt prefilled in two chunks of 64, then 12 greedy tokens: transformers' own, on the
    float32 model whose linear weights were rounded to float16; every linear layer is an fp16w one
    (none left to the small-batch path), the rest float32."""
    from transformers import AutoModelForCausalLM

    print(f"kernel path: {kernel_path().short('fp16w')}")
    engine = make_engine(tiny, weights_dtype="fp16w", decoder=decoder)
    model = engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Fp16Linear))]
    assert linears and all(isinstance(m, Fp16Linear) for m in linears), linears[:2]
    assert not any(isinstance(m, SmallBatchLinear) for m in model.modules())
    assert isinstance(model.lm_head, Fp16Linear)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert engine.kv_cache().dtype == "float32"
    want = _hf_greedy(_rounded_to_fp16(AutoModelForCausalLM.from_pretrained(str(tiny)).eval()), PROMPT, 12)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    assert tokens_of(run_to_completion(engine)["r"]) == want
    assert_pool_idle(engine)


@pytest.mark.parametrize("rows", [1, 3, 8, 100])
def test_an_fp16w_product_is_the_float32_product_of_the_rounded_weights(rows):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(576, 200)
    x = torch.randn(rows, 576)
    layer = quantize_linear_fp16(torch.nn.Sequential(linear))[0]
    assert isinstance(layer, Fp16Linear)
    with torch.inference_mode():
        got = layer(x)
        want = x @ linear.weight.half().float().t() + linear.bias
        assert got.dtype == torch.float32 and got.shape == (rows, 200)
        assert _relative_error(got, want).max() < 1e-5
        assert torch.equal(layer.product()(x), got)
        assert torch.equal(layer(x[None]), got[None])  # any leading shape
    # the rounding is the weights' own: the float32 weights give another product
    assert _relative_error(got, linear(x).detach()).max() > 1e-5


@pytest.mark.parametrize(("flags", "missing"), [({"avx2"}, "f16c"), ({"f16c", "fma"}, "avx2"), (set(), "avx2, f16c")])
def test_fp16w_is_refused_on_a_cpu_without_its_features(tiny, monkeypatch, flags, missing):
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset(flags))
    with pytest.raises(ValueError, match=f"weights_dtype fp16w .*lacks {missing}$"):
        EngineConfig(model_path=str(tiny), weights_dtype="fp16w")
    EngineConfig(model_path=str(tiny), weights_dtype="float32")  # other formats do not ask


def test_fp16w_is_checked_by_name(tiny):
    with pytest.raises(ValueError, match="weights_dtype fp16w is not supported with tensor_parallel_size > 1"):
        EngineConfig(model_path=str(tiny), weights_dtype="fp16w", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="weights_dtype must be one of .*'fp16w'.*got 'fp16'"):
        EngineConfig(model_path=str(tiny), weights_dtype="fp16")
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig(model_path=str(tiny), kv_dtype="fp16w")  # a weights format only
    config = EngineConfig(model_path=str(tiny), weights_dtype="fp16w")
    assert config.torch_dtype == torch.float32 and config.kv_torch_dtype == torch.float32
