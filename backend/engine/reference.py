"""The reference the engine's greedy tokens are checked against: transformers' own forward and KV
cache, one token a step, EOS not special. The tests (``tests/conftest.py``) and the GPU check
(``perf/gpu_check.py``) both compare with it."""

from __future__ import annotations

import inspect

import torch


def hf_greedy(model, ids: list[int], n: int, device: str = "cpu") -> list[int]:
    """``n`` greedy tokens after ``ids`` from a transformers causal LM on ``device``."""
    # the KV cache keyword: ``cache`` in newer transformers, ``past_key_values`` before
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out, past = [], None
    x = torch.tensor([ids], device=device)
    with torch.inference_mode():
        for _ in range(n):
            r = model(input_ids=x, use_cache=True, **{key: past})
            past = r.past_key_values
            tok = int(r.logits[0, -1].argmax())
            out.append(tok)
            x = torch.tensor([[tok]], device=device)
    return out
