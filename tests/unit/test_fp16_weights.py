"""``weights_dtype=fp16w``: with every product through the float16 weights, the engine's greedy
tokens are transformers' on the same model with its linear weights rounded to float16 (float32
compute), through both decoders; an fp16w product of up to ``max_rows`` rows is the float32
product with float16-rounded weights, of more rows exactly float32's product; the row limit
follows the thread count; the format is refused by name on a CPU without the features fbgemm's
kernel needs and with tensor parallelism. ``fp16w-bf16``: the same few-row products, bfloat16
ones (oneDNN: AMX tiles or AVX512-BF16) beyond the limit; auto picks it where the CPU has
either."""

from __future__ import annotations

import pytest
import torch

from backend.engine import cpu_kernels, fp16_linear
from backend.engine.config import EngineConfig
from backend.engine.formats import kernel_path_line
from backend.engine.fp16_linear import Fp16Linear, fp16_max_rows, quantize_linear_fp16
from backend.engine.sampling_params import SamplingParams
from backend.engine.small_batch_linear import SmallBatchLinear
from tests.engine_helpers import assert_pool_idle, build_tiny_llama, make_engine, run_to_completion, tokens_of
from tests.unit.test_weight_formats import PROMPT, _hf_greedy, _relative_error

NEEDS_BF16 = (
    "fp16w-bf16's products need AMX-BF16 or AVX512-BF16, which this CPU lacks "
    "(its refusal and auto's choice are tested)"
)
NO_BF16 = pytest.mark.skipif(bool(cpu_kernels.missing_flags([cpu_kernels.BF16_PRODUCTS])), reason=NEEDS_BF16)


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
def test_fp16w_tokens_equal_transformers_on_fp16_rounded_weights(tiny, decoder, monkeypatch):
    """The prompt prefilled in two chunks of 64, then 12 greedy tokens, every product through the
    float16 weights (the row limit lifted): transformers' own, on the float32 model whose linear
    weights were rounded to float16; every linear layer is an fp16w one (none left to the
    small-batch path), the rest float32."""
    from transformers import AutoModelForCausalLM

    print(kernel_path_line("fp16w"))
    monkeypatch.setattr(fp16_linear, "fp16_max_rows", lambda threads: 10**9)
    # a float32 pool (kv_dtype=auto takes float16 under fp16w): the weights alone are compared here
    engine = make_engine(tiny, weights_dtype="fp16w", decoder=decoder, kv_dtype="float32")
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


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_an_fp16w_product_is_the_float32_product_of_the_rounded_weights(rows):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(576, 200)
    x = torch.randn(rows, 576)
    layer = quantize_linear_fp16(torch.nn.Sequential(linear), max_rows=16)[0]
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


def _kernel_calls(fn) -> int:
    profile = torch.profiler.profile()
    with profile:
        fn()
    return sum(e.name == "group_kernel::f16_matmul" for e in profile.events())


def test_which_kernel_takes_an_fp16w_product(kernels):
    """Up to 16 rows: our float16 product (on both kernel paths, the same products as the float32
    product of the rounded weights); 17 up to ``max_rows`` (64 on one thread): fbgemm's; a layer
    whose inputs are not a multiple of 16: fbgemm's for every few-row product."""
    torch.manual_seed(5)
    linear, odd = torch.nn.Linear(576, 200), torch.nn.Linear(200, 24)
    layer = quantize_linear_fp16(torch.nn.Sequential(linear), max_rows=64, threads=2)[0]
    narrow = quantize_linear_fp16(torch.nn.Sequential(odd), max_rows=64)[0]
    assert layer.half_weight is not None and layer._packed_weight is not None and narrow.half_weight is None
    x = torch.randn(64, 576)
    with torch.inference_mode():
        for rows, calls in ((1, 1), (16, 1), (17, 0), (64, 0)):
            got = layer(x[:rows])
            want = x[:rows] @ linear.weight.half().float().t() + linear.bias
            assert _relative_error(got, want).max() < 1e-5, rows
            assert _kernel_calls(lambda r=rows: layer(x[:r])) == calls, rows
        packed = layer._packed_weight
        assert torch.equal(layer(x[:17]), torch.fbgemm_linear_fp16_weight_fp32_activation(x[:17], packed, linear.bias))
        assert _kernel_calls(lambda: narrow(x[:3, :200])) == 0
        want = x[:3, :200] @ odd.weight.half().float().t() + odd.bias
        assert _relative_error(narrow(x[:3, :200]), want).max() < 1e-5


@pytest.mark.parametrize("rows", [17, 100])
def test_an_fp16w_product_of_more_rows_than_its_limit_is_float32s(rows):
    """Prefill chunks: beyond ``max_rows`` the layer multiplies by its float32 weights, bit for bit
    what a float32 layer computes."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(576, 200)
    x = torch.randn(rows, 576)
    layer = quantize_linear_fp16(torch.nn.Sequential(linear), max_rows=16)[0]
    with torch.inference_mode():
        want = torch.nn.functional.linear(x, linear.weight, linear.bias)
        assert torch.equal(layer(x), want)
        assert torch.equal(layer.product()(x[None]), want[None])
        assert not torch.equal(layer(x[:16]), want[:16])  # 16 rows: the float16 weights


@NO_BF16
@pytest.mark.parametrize("rows", [17, 100])
def test_an_fp16w_bf16_product_of_more_rows_than_its_limit_is_a_bfloat16_product(rows):
    """Beyond ``max_rows``: the input and the weights rounded to bfloat16, float32 sums, the output
    rounded to bfloat16 (oneDNN's linear returns its input's dtype), then widened; the bias added
    in float32. Up to the limit: the float16 weights' product, as fp16w's."""
    print(kernel_path_line("fp16w-bf16"))
    torch.manual_seed(rows)
    linear = torch.nn.Linear(576, 200)
    x = torch.randn(rows, 576)
    layer = quantize_linear_fp16(torch.nn.Sequential(linear), max_rows=16, weights="fp16w-bf16")[0]
    assert layer.many_rows == torch.bfloat16 and layer.weight is None  # no float32 copy is kept
    with torch.inference_mode():
        got = layer(x)
        exact = (x.bfloat16().double() @ linear.weight.bfloat16().double().t()).float()
        assert got.dtype == torch.float32 and got.shape == (rows, 200)
        # only the output's rounding to bfloat16 (8 significant bits) and the order of the sums
        assert (got - linear.bias - exact).abs().max() <= exact.abs().max() * 2**-8
        assert _relative_error(got, linear(x)).max() > 1e-4  # not float32's product
        assert torch.equal(layer.product()(x[None]), got[None])
        want16 = x[:16] @ linear.weight.half().float().t() + linear.bias
        assert _relative_error(layer(x[:16]), want16).max() < 1e-5  # 16 rows: the float16 weights


@NO_BF16
def test_fp16w_bf16_engine_runs_its_layers(tiny):
    """An engine with fp16w-bf16: every linear layer an Fp16Linear with bfloat16 beyond its limit;
    a prompt of 40 tokens (one many-row step) then decode steps complete and free their pages."""
    engine = make_engine(tiny, weights_dtype="fp16w-bf16")
    layers = [m for m in engine.runner.model.modules() if isinstance(m, Fp16Linear)]
    assert layers and all(m.many_rows == torch.bfloat16 for m in layers)
    engine.add_request("r", (PROMPT * 3)[:40], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(tokens_of(run_to_completion(engine)["r"])) == 6
    assert_pool_idle(engine)


def test_the_row_limit_follows_the_thread_count(monkeypatch):
    """Measured crossovers with float32 (fp16_linear's docstring): 64 rows on 1 thread, 16 on 2,
    fewer beyond; a layer takes the limit of torch's thread count when it is built."""
    assert [fp16_max_rows(t) for t in (1, 2, 4, 8, 16)] == [64, 16, 4, 1, 1]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert Fp16Linear(torch.nn.Linear(8, 8)).max_rows == 16


@pytest.mark.parametrize(("flags", "missing"), [({"avx2"}, "f16c"), ({"f16c", "fma"}, "avx2"), (set(), "avx2, f16c")])
def test_fp16w_is_refused_on_a_cpu_without_its_features(tiny, monkeypatch, flags, missing):
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset(flags))
    with pytest.raises(ValueError, match=f"weights_dtype fp16w .*lacks {missing}$"):
        EngineConfig(model_path=str(tiny), weights_dtype="fp16w")
    EngineConfig(model_path=str(tiny), weights_dtype="float32")  # other formats do not ask


@pytest.mark.parametrize(
    ("fmt", "flags", "missing"),
    [
        ("fp16w-bf16", {"avx2", "f16c"}, "amx_bf16 or avx512_bf16"),
        ("fp16w-bf16", {"amx_bf16"}, "avx2, f16c"),
        ("int4w-bf16", {"avx2", "f16c", "fma"}, "amx_bf16 or avx512_bf16"),
    ],
)
def test_the_bf16_formats_are_refused_on_a_cpu_without_their_features(tiny, monkeypatch, fmt, flags, missing):
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset(flags))
    with pytest.raises(ValueError, match=f"weights_dtype {fmt} needs .*AMX-BF16 or AVX512-BF16.*lacks {missing}$"):
        EngineConfig(model_path=str(tiny), weights_dtype=fmt)
    with pytest.raises(ValueError, match=f"weights_dtype {fmt} is not supported with tensor_parallel_size > 1"):
        EngineConfig(model_path=str(tiny), weights_dtype=fmt, tensor_parallel_size=2)


def test_fp16w_is_checked_by_name(tiny):
    with pytest.raises(ValueError, match="weights_dtype fp16w is not supported with tensor_parallel_size > 1"):
        EngineConfig(model_path=str(tiny), weights_dtype="fp16w", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="weights_dtype must be one of .*'fp16w'.*got 'fp16'"):
        EngineConfig(model_path=str(tiny), weights_dtype="fp16")
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig(model_path=str(tiny), kv_dtype="fp16w")  # a weights format only
    config = EngineConfig(model_path=str(tiny), weights_dtype="fp16w")
    assert config.torch_dtype == torch.float32 and config.kv_torch_dtype == torch.float16  # kv_dtype=auto
    assert EngineConfig(model_path=str(tiny), weights_dtype="fp16w", kv_dtype="float32").kv_torch_dtype == torch.float32


def test_auto_picks_fp16w_where_it_runs_and_says_why(tiny, monkeypatch):
    """``weights_dtype=auto`` (the default): the fastest format within float32's quality (1.01x
    held-out perplexity, 99% decode-step argmax agreement) that the CPU runs: fp16w-bf16 on a CPU
    with AMX-BF16 or AVX512-BF16, fp16w on one with AVX2 and F16C only
    (the reason names what fp16w-bf16 lacks); float32 where fbgemm's kernel cannot run
    (the reason names the missing feature) or with tensor parallelism; a float ``dtype`` other
    than float32 keeps its own weights. A format set by name is taken as it is. Both kernel paths
    are forced here, whatever this CPU has."""
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx2", "f16c", "fma", "amx_bf16"}))
    config = EngineConfig(model_path=str(tiny))
    assert config.weights_format == "fp16w-bf16" and config.torch_dtype == torch.float32
    assert "fastest format within 1.01x" in config.weights_choice and "(fp16w-bf16 1.001x, " in config.weights_choice
    assert "99% next-token agreement" in config.weights_choice, config.weights_choice
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx2", "f16c", "fma"}))
    config = EngineConfig(model_path=str(tiny))
    assert config.weights_format == "fp16w" and config.torch_dtype == torch.float32
    assert "; fp16w-bf16 needs amx_bf16 or avx512_bf16; int4w: not a Q4_1 checkpoint)" in config.weights_choice, (
        config.weights_choice
    )
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx2", "f16c", "fma", "avx512_bf16"}))
    assert EngineConfig(model_path=str(tiny)).weights_format == "fp16w-bf16"  # no AMX: AVX512-BF16's products
    assert EngineConfig(model_path=str(tiny), tensor_parallel_size=2).weights_format == "float32"
    bf16 = EngineConfig(model_path=str(tiny), dtype="bfloat16")
    assert bf16.weights_format == "bfloat16" and bf16.kv_format == "bfloat16"
    explicit = EngineConfig(model_path=str(tiny), weights_dtype="float32")
    assert explicit.weights_format == "float32" and explicit.weights_choice == ""
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx2", "fma", "amx_bf16"}))
    config = EngineConfig(model_path=str(tiny))
    assert config.weights_format == "float32" and config.weights_choice.endswith("this CPU lacks f16c")


def test_auto_engine_runs_fp16w_and_logs_the_choice(tiny, caplog):
    """The engine built from the default config: its linear layers are fp16w ones where the CPU
    has fbgemm's features, and the start log names the format and why."""
    caplog.set_level("INFO", logger="triton_disagg.engine")
    engine = make_engine(tiny, weights_dtype="auto")
    flags = cpu_kernels.cpu_flags()
    bf16 = not cpu_kernels.missing_flags([cpu_kernels.BF16_PRODUCTS])
    want = "float32" if not {"avx2", "f16c"} <= flags else "fp16w-bf16" if bf16 else "fp16w"
    print(f"auto on this CPU ({cpu_kernels.cpu_model()}): {want}")
    head = engine.runner.model.lm_head
    assert isinstance(head, Fp16Linear) == (want != "float32")
    if want != "float32":
        assert head.many_rows == (torch.bfloat16 if want == "fp16w-bf16" else torch.float32)
    assert f"weights={want} (auto: " in caplog.text, caplog.text
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(tokens_of(run_to_completion(engine)["r"])) == 4
    assert_pool_idle(engine)
