"""Weight and KV formats of the engine (``weights_dtype``, ``kv_dtype``): int8 weights give the
output of transformers running the same int8 model, whatever the chunking of the prompt (the
activations are quantized per row), a bfloat16 KV cache under float32 weights
is really bfloat16 and stays close, bad combinations are refused by name, and two instances
whose KV formats differ cannot pair up (the fabric handshake's layout check)."""

from __future__ import annotations

import pytest
import torch

from backend.disagg.nixl_connector import kv_layout
from backend.engine import int8_linear
from backend.engine.config import EngineConfig
from backend.engine.cpu_kernels import kernel_path
from backend.engine.int8_linear import FULL_RANGE, REDUCED_RANGE, Int8Linear, rotate_residual_stream
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


# The relative error of a product with per-row int8 activations, by activation range (one step
# of the range is 1/127 or 1/63 of the row's max |x|): 0.019 and 0.032 on the rows below.
ERROR_BOUND = {FULL_RANGE: 0.025, REDUCED_RANGE: 0.045}


def _rows_with_outliers() -> tuple[torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(6, 96)
    x[0] *= 1000.0
    x[3, 7] = 300.0  # an outlier feature inside one row
    return torch.nn.Linear(96, 40), x


def _emulated(linear: torch.nn.Linear, x: torch.Tensor, quant: tuple[float, int]) -> torch.Tensor:
    """What fbgemm's int8 product computes for ``quant`` (scale, zero point), in float64 with no
    kernel: the weights in int8 per output channel, each row divided by its max |x|, rounded onto
    the activation range as uint8, and multiplied back."""
    w = linear.weight.double()
    w_scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
    w_q = torch.clamp(torch.round(w / w_scale), -128, 127) * w_scale
    row_max = x.double().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    scale, zero_point = quant
    x_q = (torch.clamp(torch.round(x.double() / row_max / scale) + zero_point, 0, 255) - zero_point) * scale
    return (x_q @ w_q.t()) * row_max + linear.bias.double()


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got.double() - want.double()).norm(dim=-1) / want.double().norm(dim=-1)


@pytest.mark.parametrize("quant", [FULL_RANGE, REDUCED_RANGE], ids=["8-bit", "7-bit"])
def test_each_int8_activation_range_keeps_its_error_bound(quant):
    """Both kernel paths' arithmetic, on any CPU (emulated, no kernel): rows 1000x apart and an
    outlier feature inside a row, each within the bound of its activation range."""
    linear, x = _rows_with_outliers()
    with torch.inference_mode():
        error = _relative_error(_emulated(linear, x, quant), linear(x))
    assert error.max() < ERROR_BOUND[quant], error


def test_int8_rows_do_not_depend_on_the_other_rows():
    """Per-row activation scales through this CPU's kernel: a row's product is the same bits
    alone, in any batch, and next to a row with outliers 1000x larger (one scale per tensor
    rounds this row to a few levels); the kernel computes the arithmetic of its path (the
    emulation) and keeps that path's bound."""
    linear, x = _rows_with_outliers()
    q = Int8Linear(linear)
    path = kernel_path()
    print(f"kernel path: {path.int8_path} on {path.cpu} ({path.cpu_id})")
    assert q.quant == (FULL_RANGE if path.int8_full_range else REDUCED_RANGE)
    with torch.inference_mode():
        together = q(x)
        for i in range(6):
            assert torch.equal(q(x[i : i + 1]), together[i : i + 1])
        assert torch.equal(q(x[None, 2:5]), together[None, 2:5])  # any leading shape
        exact = linear(x)
    assert _relative_error(together, _emulated(linear, x, q.quant)).max() < 1e-5
    assert _relative_error(together, exact).max() < ERROR_BOUND[q.quant]


@pytest.mark.parametrize("exact", [True, False], ids=["vnni", "no-vnni"])
def test_the_int8_range_follows_the_kernel_check(monkeypatch, exact):
    """Both paths forced: the full 8-bit range only where the kernel check passed."""
    monkeypatch.setattr(int8_linear, "full_range_is_exact", lambda: exact)
    assert Int8Linear(torch.nn.Linear(8, 4)).quant == (FULL_RANGE if exact else REDUCED_RANGE)


@pytest.mark.parametrize("saturates", [True, False], ids=["saturating-kernel", "exact-kernel"])
def test_the_kernel_check_detects_saturating_pair_sums(monkeypatch, saturates):
    """The check itself, against an emulated kernel that sums u8*s8 pairs into int16 with
    saturation (fbgemm's AVX2 path without VNNI) and one that does not."""

    def kernel(x, packed, quant):
        weight = packed.unpack()[0].int_repr().int()  # [out, in]
        scale, zero_point = quant
        x_q = torch.clamp(torch.round(x / scale) + zero_point, 0, 255).int()
        pairs = (x_q[:, None, :] * weight[None, :, :]).reshape(x.shape[0], weight.shape[0], -1, 2).sum(-1)
        if saturates:
            pairs = pairs.clamp(-32768, 32767)
        zero_term = zero_point * weight.sum(-1)
        w_scale = packed.unpack()[0].q_per_channel_scales().float()
        return (pairs.sum(-1) - zero_term).float() * scale * w_scale

    monkeypatch.setattr(int8_linear, "_fixed_range_product", kernel)
    assert int8_linear.full_range_is_exact.__wrapped__() is not saturates


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
