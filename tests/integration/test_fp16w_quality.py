"""``weights_dtype=fp16w`` keeps float32's quality on the real checkpoint: the same measurement as
``test_int8_quality.py`` (held-out English teacher forced through the engine's runner, a
512-token prompt prefilled in chunks of 256, then 32 decode steps; figures as
``perf/bench_formats.py`` computes them), with tighter bounds, since only the weights are rounded
(to float16) and the products sum in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.engine.config import EngineConfig
from backend.engine.cpu_kernels import kernel_path
from backend.engine.model_runner import ModelRunner
from perf.bench_formats import _heldout_figures, heldout_windows
from tests.engine_helpers import real_model_dir
from tests.integration.test_int8_quality import TEXT, _logits


def _nll_and_argmax(model: str, fmt: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per scored position (a batch of one window): the text's next token's negative
    log-likelihood and the argmax token under ``fmt``."""
    runner = ModelRunner(EngineConfig(model_path=model, weights_dtype=fmt, kv_cache_tokens=1024))
    with torch.inference_mode():
        logits = _logits(runner, ids)
    nll = -F.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return nll[None], logits.argmax(-1)[None]


def test_fp16w_perplexity_and_argmax_stay_with_float32():
    from transformers import AutoTokenizer

    print(f"kernel path: {kernel_path().short('fp16w')}")
    model = str(real_model_dir())
    (ids,) = heldout_windows(AutoTokenizer.from_pretrained(model), TEXT, 1)  # the first 512 + 32 tokens
    reference = _nll_and_argmax(model, "float32", ids)
    figures = _heldout_figures(*_nll_and_argmax(model, "fp16w", ids), reference)
    print("fp16w against float32:", {k: round(v, 4) for k, v in figures.items()})
    for part in ("prefill", "decode"):
        assert figures[f"heldout_ppl_ratio_{part}"] < 1.01, figures
        assert figures[f"heldout_argmax_agree_{part}"] > 0.95, figures
