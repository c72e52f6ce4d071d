"""``weights_dtype=fp16w`` keeps float32's quality on the real checkpoint: the same measurement as
``test_int8_quality.py`` (held-out English teacher forced through the engine's runner, a
512-token prompt prefilled in chunks of 256, then 32 decode steps; figures as
``perf/bench_formats.py`` computes them), with tighter bounds, since only the weights are rounded
(to float16) and the products sum in float32. Measured with every product through the float16
weights (the row limit lifted): the prompt's positions would otherwise take the float32 weights
of the prefill chunks and say nothing of the format's quality; the default split can only be
closer to float32."""

from __future__ import annotations

from backend.engine import fp16_linear
from backend.engine.cpu_kernels import kernel_path
from perf.bench_formats import heldout_figures, heldout_windows
from tests.engine_helpers import real_model_dir
from tests.integration.test_int8_quality import TEXT, nll_and_argmax


def test_fp16w_perplexity_and_argmax_stay_with_float32(monkeypatch):
    from transformers import AutoTokenizer

    print(f"kernel path: {kernel_path().short('fp16w')}")
    model = str(real_model_dir())
    (ids,) = heldout_windows(AutoTokenizer.from_pretrained(model), TEXT, 1)  # the first 512 + 32 tokens
    reference = nll_and_argmax(model, "float32", ids)
    monkeypatch.setattr(fp16_linear, "fp16_max_rows", lambda threads: 10**9)
    figures = heldout_figures(*nll_and_argmax(model, "fp16w", ids), reference)
    print("fp16w against float32:", {k: round(v, 4) for k, v in figures.items()})
    for part in ("prefill", "decode"):
        assert figures[f"heldout_ppl_ratio_{part}"] < 1.01, figures
        assert figures[f"heldout_argmax_agree_{part}"] > 0.95, figures
