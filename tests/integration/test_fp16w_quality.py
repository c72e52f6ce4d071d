"""``weights_dtype=fp16w`` keeps float32's quality (and ``fp16w-bf16`` stays within what auto
asks) on the real checkpoint: the measurement of ``format_quality.py`` (held-out English
teacher forced through the engine's runner, a 512-token prompt prefilled in chunks of 256, then 32
decode steps; figures as ``perf/bench_formats.py`` computes them), with tighter bounds, since only
the weights are rounded (to float16) and the products sum in float32. Measured with every product
through the float16 weights (the row limit lifted): the prompt's positions would otherwise take the
float32 weights of the prefill chunks and say nothing of the format's quality; the default split
can only be closer to float32."""

from __future__ import annotations

from backend.engine import fp16_linear
from backend.engine.formats import kernel_path_line
from backend.engine.heldout import heldout_figures, heldout_windows
from tests.engine_helpers import real_model_dir
from tests.integration.format_quality import TEXT, float32_reference, nll_and_argmax_windows


def test_fp16w_perplexity_and_argmax_stay_with_float32(monkeypatch):
    from transformers import AutoTokenizer

    print(kernel_path_line("fp16w"))
    model = str(real_model_dir())
    (ids,) = heldout_windows(AutoTokenizer.from_pretrained(model), TEXT, 1)  # the first 512 + 32 tokens
    reference = float32_reference(model, 1)
    monkeypatch.setattr(fp16_linear, "fp16_max_rows", lambda threads: 10**9)
    figures = heldout_figures(*nll_and_argmax_windows(model, "fp16w", [ids], 2), reference)
    print("fp16w against float32:", {k: round(v, 4) for k, v in figures.items()})
    for part in ("prefill", "decode"):
        assert figures[f"heldout_ppl_ratio_{part}"] < 1.01, figures
        assert figures[f"heldout_argmax_agree_{part}"] > 0.95, figures


def test_fp16w_bf16_perplexity_and_argmax_stay_with_float32():
    """``fp16w-bf16`` as ``serve`` runs it, on all seven held-out windows (512 + 32 tokens each),
    2 threads: the prompt's chunks of 256 rows in bfloat16 (AMX tiles, or AVX512-BF16), the decode
    steps through the float16 weights over the KV those chunks wrote. Measured on AMX tiles (an
    Intel Xeon): prompt 1.0007x float32's perplexity, argmax agreement 97.4%; decode steps
    0.9995x, 99.55%; with AVX512-BF16 (an AMD EPYC, family 25 model 17): prompt 1.0006x, 97.37%;
    decode steps 0.9998x, 99.55%. Bounds: perplexity within 1.01x and decode-step agreement at least 98%
    (auto takes the format for 99%: one miss in 224 positions is 0.45%, so the bound leaves room
    for the last bits of another CPU)."""
    import pytest
    from transformers import AutoTokenizer

    from backend.engine.cpu_kernels import BF16_PRODUCTS, missing_flags

    if missing_flags([BF16_PRODUCTS]):
        pytest.skip(reason=f"fp16w-bf16 needs AMX-BF16 or AVX512-BF16, which this CPU lacks ({kernel_path_line()})")
    print(kernel_path_line("fp16w-bf16"))
    model = str(real_model_dir())
    windows = heldout_windows(AutoTokenizer.from_pretrained(model), TEXT, 8)
    figures = heldout_figures(*nll_and_argmax_windows(model, "fp16w-bf16", windows, 2), float32_reference(model))
    print("fp16w-bf16 against float32:", {k: round(v, 4) for k, v in figures.items()})
    for part in ("prefill", "decode"):
        assert figures[f"heldout_ppl_ratio_{part}"] < 1.01, figures
    assert figures["heldout_argmax_agree_prefill"] > 0.95, figures
    assert figures["heldout_argmax_agree_decode"] >= 0.98, figures
