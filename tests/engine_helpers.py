"""Shared helpers for the engine tests: a tiny random Llama checkpoint, the real checkpoint
(:func:`tests.checkpoint.real_model_dir`), and running an engine until its requests finish."""

from __future__ import annotations

import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from backend.engine.config import EngineConfig  # noqa: E402
from backend.engine.llm_engine import LLMEngine  # noqa: E402
from backend.engine.outputs import EngineOutput  # noqa: E402
from backend.engine.remote_admission import RemoteLoader, admit_remote  # noqa: E402, F401  (the engine tests import them from here)
from backend.parallel.engine_factory import build_engine  # noqa: E402
from tests.checkpoint import real_model_dir  # noqa: E402, F401  (the engine tests import it from here)

TINY_VOCAB = 256


def build_tiny_llama(path: Path) -> Path:
    """Random 2-layer Llama (hidden 64, 4 heads, 2 KV heads, vocab 256) saved as a checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits than the default init, so greedy choices are not near-ties
        model.lm_head.weight.mul_(20)
    model.save_pretrained(path)
    return path


def prompt_of(length: int, seed: int = 0) -> list[int]:
    """Random token ids of the tiny model's vocabulary (ids 0-2 are special)."""
    return torch.randint(3, TINY_VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_engine(model_dir: Path, store=None, disk_reader=None, **overrides) -> LLMEngine:
    """An engine on ``model_dir`` with small limits and no disk KV tier; float32 weights unless ``overrides`` name a
    format (the tests compare with transformers' float32; ``weights_dtype``'s default, auto,
    picks fp16w on most CPUs)."""
    settings = dict(
        model_path=str(model_dir),
        kv_cache_tokens=2048,
        max_num_batched_tokens=64,
        max_model_len=512,
        weights_dtype="float32",
        kv_disk_bytes=0,  # no files shared between tests; the disk tier's tests name their own
    )
    settings.update(overrides)
    return build_engine(EngineConfig(**settings), store, disk_reader)


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[EngineOutput]]:
    """Step until idle; outputs grouped by request id."""
    outputs: dict[str, list[EngineOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.req_id, []).append(out)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def assert_pool_idle(engine: LLMEngine) -> None:
    stats = engine.pool_stats()
    assert stats["free"] == stats["total"], f"pages leaked: {stats}"
    assert stats["requests"] == 0 and stats["committed"] == 0, stats
    assert not engine.has_work() and not engine.active_request_ids()


class Listener:
    """A KV step listener (the engine's seam to a KV connector) made of two callables."""

    def __init__(self, on_step=None, on_layer=None):
        self.on_step, self.on_layer = on_step, on_layer

    def step_scheduled(self, batch) -> None:
        if self.on_step is not None:
            self.on_step(batch)

    def layer_written(self, layer, batch, written) -> None:
        assert written.wait(10.0), "the engine's device mark for a written layer never completed"
        if self.on_layer is not None:
            self.on_layer(layer, batch)
