"""The held-out quality harness of the weight formats' tests (``test_fp16w_quality.py``,
``test_int4w_quality.py``): perplexity on held-out English (``perf/data/heldout_en.txt``) teacher
forced through the engine's runner, a 512-token prompt prefilled in chunks of 256
(``max_num_batched_tokens``' default), then 32 tokens fed one decode step at a time; float32's
figures computed once per session as the reference."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from backend.engine.config import EngineConfig
from backend.engine.heldout import heldout_windows
from backend.engine.model_runner import ModelRunner
from backend.engine.protocol import BatchEntry

TEXT = Path(__file__).resolve().parents[2] / "perf" / "data" / "heldout_en.txt"
PROMPT, DECODE, CHUNK, PAGE = 512, 32, 256, 16


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits at every position but the last: the prompt in chunks, then one token per step."""
    pages = list(range(-(-len(ids) // PAGE)))
    out = [
        runner.run([BatchEntry(ids[s : s + CHUNK], s, pages)], num_logits=[len(ids[s : s + CHUNK])]).position_logits[0]  # type: ignore[index]
        for s in range(0, PROMPT, CHUNK)
    ]
    out += [runner.run([BatchEntry([ids[p]], p, pages)]).logits for p in range(PROMPT, len(ids) - 1)]
    return torch.cat(out).float()


def nll_and_argmax_windows(
    model: str, fmt: str, windows: list[list[int]], num_threads: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per window and scored position ([windows, positions] each, one runner): the text's next
    token's negative log-likelihood and the argmax token under weights format ``fmt``."""
    runner = ModelRunner(
        EngineConfig(model_path=model, weights_dtype=fmt, kv_cache_tokens=1024, num_threads=num_threads)
    )
    nll, top = [], []
    with torch.inference_mode():
        for ids in windows:
            logits = _logits(runner, ids)
            nll.append(-F.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0])
            top.append(logits.argmax(-1))
    return torch.stack(nll), torch.stack(top)


_FLOAT32: dict = {}


def float32_reference(model: str, count: int = 7, num_threads: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """float32's figures on the first ``count`` held-out windows (at most 7): computed once per
    session and thread count on all seven (each format's quality test compares with them; a
    window's figures do not depend on the windows run before it with the same runner)."""
    from transformers import AutoTokenizer

    key = (model, num_threads)
    if key not in _FLOAT32:
        every = heldout_windows(AutoTokenizer.from_pretrained(model), TEXT, 8)
        _FLOAT32[key] = nll_and_argmax_windows(model, "float32", every, num_threads)
    nll, top = _FLOAT32[key]
    return nll[:count], top[:count]
