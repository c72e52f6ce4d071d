"""``weights_dtype=int4w`` keeps float32's quality on the real checkpoint: the measurement of
``test_fp16w_quality.py`` (held-out English teacher forced through the engine's runner, 512-token
prompts prefilled in chunks of 256, then 32 decode steps; all seven windows), with every product
through the 4-bit groups (the row limits lifted, so the prompt positions measure the format too).
The project's checkpoint was converted from a Q4_1 GGUF, so every group is exact and only the
order of the sums differs from float32's; the bounds are fp16w's."""

from __future__ import annotations

from backend.engine import fp16_linear, group_linear, model_runner
from backend.engine.formats import kernel_path_line
from backend.engine.heldout import heldout_figures, heldout_windows
from tests.engine_helpers import real_model_dir
from tests.integration.format_quality import TEXT, float32_reference, nll_and_argmax_windows


def test_int4w_perplexity_and_argmax_stay_with_float32(monkeypatch):
    from transformers import AutoTokenizer

    print(kernel_path_line("int4w"))
    model = str(real_model_dir())
    windows = heldout_windows(AutoTokenizer.from_pretrained(model), TEXT, 8)
    reference = float32_reference(model)
    monkeypatch.setattr(model_runner, "fp16_max_rows", lambda threads: 10**9)
    monkeypatch.setattr(fp16_linear, "fp16_max_rows", lambda threads: 10**9)
    monkeypatch.setattr(group_linear, "MAX_ROWS", 10**9)
    figures = heldout_figures(*nll_and_argmax_windows(model, "int4w", windows, 2), reference)
    print("int4w against float32:", {k: round(v, 4) for k, v in figures.items()})
    for part in ("prefill", "decode"):
        assert abs(figures[f"heldout_ppl_ratio_{part}"] - 1) < 0.001, figures
        assert figures[f"heldout_argmax_agree_{part}"] >= 0.99, figures
