"""EmulatedRunner: the runner of an emulated instance (``EngineConfig.emulate``). Everything around
the model is real (scheduler, paged KV pool, prefix cache, tiers, the per-layer "written" signal,
and above it the serving layer, the KV fabric, membership, routing); the model's arithmetic is
replaced by a wait and a deterministic token generator.

- **The wait**: a step takes what the engine profile (``step_profile.py``) says its chunks take,
  spread over the layers: layer ``l`` queues its KV write, fires the layer hook, and the step
  sleeps until ``(l + 1) / num_layers`` of its time has passed. A sleeping instance uses no CPU,
  so many fit on one machine.
- **The tokens**: each position's KV holds a 24-bit hash of every token up to it, ``h[p] =
  mix(h[p - 1], token[p])``, written as three integers below 256 (exact in every KV dtype) into
  head 0 of that position's K, in every layer; a step reads ``h[start - 1]`` back from layer
  ``(start - 1) % num_layers`` of the pages. The token after position ``p`` is a function of
  ``h[p]`` alone (never an end token: requests end by their length). So a token depends on every
  token before it *through the KV cache*: a page lost or misplaced by a transfer, a tier or the
  prefix cache changes the tokens from there on, and a moved or resumed request continues token
  for token as it would have.

The pool is small: the checkpoint's layer count, one KV head of :data:`HEAD_DIM` values per
token. The checkpoint gives the vocabulary and the end tokens (its tokenizer serves the text).
Logits put the token at 0 and every other at :data:`OTHER_LOGIT`: greedy and sampled requests take
it alike, with log-probability about 0.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from backend.engine.config import EngineConfig
from backend.engine.device_progress import make_progress
from backend.engine.kv_pool import KVPool
from backend.engine.protocol import BatchEntry, DeviceMark, ModelDims, StepResult
from backend.engine.step_profile import EngineProfile, StepCost, profile_path

log = logging.getLogger("triton_disagg.engine")

HEAD_DIM = 4  # three hash bytes and a spare: the smallest head that holds the generator's state
HIDDEN = 8  # the hidden state a prefill ships with its KV (zeros: the generator needs none)
OTHER_LOGIT = -100.0  # every token but the generator's (e^-100: never drawn, at any temperature)
SEED = 0x5EED5  # h[-1]
_MASK = (1 << 24) - 1


def mix(h: int, token: int) -> int:
    """The hash of a position from the one before it and its token (24 bits)."""
    return ((h * 1_000_003) ^ (token * 2_654_435_761 + 1)) & _MASK


def next_token(h: int, vocab: int, end_ids: frozenset[int]) -> int:
    """The token after a position whose hash is ``h``: never one of ``end_ids``."""
    t = (h * 48_271 + (h >> 9)) % vocab
    while t in end_ids:
        t = (t + 1) % vocab
    return t


def generate(prompt_ids: list[int], n: int, vocab: int, end_ids: frozenset[int]) -> list[int]:
    """The ``n`` tokens an emulated engine makes after ``prompt_ids``, greedy or sampled: what a
    check of a deployment compares its streams with."""
    h = SEED
    for t in prompt_ids:
        h = mix(h, t)
    out = []
    for _ in range(n):
        out.append(next_token(h, vocab, end_ids))
        h = mix(h, out[-1])
    return out


def checkpoint_shape(model_path: str) -> tuple[int, int, tuple[int, ...]]:
    """``(vocabulary, layers, end tokens)`` of a checkpoint, from its config.json (the end tokens
    from generation_config.json first, as the model runner takes them)."""
    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder / 'config.json'} not found: the emulated engine takes the vocabulary from it")
    config = json.loads((folder / "config.json").read_text())
    generation = folder / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    eos = config.get("eos_token_id") if eos is None else eos
    end = tuple(int(x) for x in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return int(config["vocab_size"]), int(config["num_hidden_layers"]), end


class EmulatedRunner:
    """The :class:`~backend.engine.protocol.Runner` of an emulated instance (module docstring)."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic, sleep=time.sleep):
        assert config.emulate  # EngineConfig resolved and checked it
        self.device = torch.device("cpu")
        self.vocab_size, self.num_layers, self._end_ids = checkpoint_shape(config.model_path)
        self._end = frozenset(self._end_ids)
        path = profile_path(config.emulate)
        profile = EngineProfile.load(path)
        threads = config.num_threads if config.num_threads in profile.threads else min(profile.threads)
        self.cost: StepCost = profile.cost(threads)
        self._clock, self._sleep = clock, sleep
        assert config.num_pages is not None
        self.pool = KVPool(
            num_layers=self.num_layers,
            num_pages=config.num_pages,
            num_kv_heads=1,
            page_size=config.page_size,
            head_dim=HEAD_DIM,
            dtype=config.kv_torch_dtype,
            device=self.device,
        )
        self.progress = make_progress(self.device)
        self._hook: Callable[[int, Any, DeviceMark], None] | None = None
        log.info(
            "emulated engine: profile %s (%s, %s, %d thread(s): %s ms per step, sequence, token, 1000 "
            "attention pairs, batched); vocabulary %d from %s; KV pool %d pages x %d tokens, %d layers x 1 "
            "head x %d (%s), %.1f MiB",
            path,
            profile.model,
            profile.weights_dtype,
            threads,
            ", ".join(f"{c * 1e3:.3g}" for c in self.cost.coef),
            self.vocab_size,
            config.model_path,
            config.num_pages,
            config.page_size,
            self.num_layers,
            HEAD_DIM,
            self.pool.dtype,
            self.pool.total_bytes / 2**20,
        )

    # ------------------------------------------------------------------ the Runner protocol
    def run(
        self, entries: list[BatchEntry], hook_arg: object = None, num_logits: list[int] | None = None
    ) -> StepResult:
        t0 = self._clock()
        seconds = self.cost.step_time([(len(e.token_ids), e.start) for e in entries])
        hashes = [self._hashes(e) for e in entries]
        pages, slots, values = self._where(entries, hashes)
        kv = self.pool.tensor
        for layer in range(self.num_layers):
            kv[layer, pages, 0, 0, slots, :3] = values
            if self._hook is not None:
                self._hook(layer, hook_arg, self.progress.mark())
            wait = t0 + seconds * (layer + 1) / self.num_layers - self._clock()
            if wait > 0:
                self._sleep(wait)
        counts = num_logits or [1] * len(entries)
        rows = [self._logits(h[len(h) - n :]) for h, n in zip(hashes, counts)]
        hidden = [torch.zeros(len(r), HIDDEN) for r in rows]
        if num_logits is None:
            return StepResult(logits=torch.cat(rows), hidden=torch.cat(hidden))
        return StepResult(
            logits=torch.stack([r[-1] for r in rows]),
            hidden=torch.zeros(len(rows), HIDDEN),
            position_logits=rows,
            position_hidden=hidden,
        )

    def set_layer_hook(self, hook: Callable[[int, Any, DeviceMark], None] | None) -> None:
        self._hook = hook

    def device_mark(self) -> DeviceMark:
        return self.progress.mark()

    def dims(self) -> ModelDims:
        return ModelDims(
            num_layers=self.num_layers,
            hidden_size=HIDDEN,
            vocab_size=self.vocab_size,
            num_kv_heads=1,
            head_dim=HEAD_DIM,
        )

    def shard_pools(self) -> list[torch.Tensor]:
        return [self.pool.tensor]

    def end_token_ids(self) -> tuple[int, ...]:
        return self._end_ids

    def health(self) -> str | None:
        return None

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Nothing to lose in one process."""

    def close(self) -> None:
        """Nothing to stop."""

    # ------------------------------------------------------------------ the generator
    def _hash_at(self, page_table: list[int], position: int) -> int:
        """``h[position]`` as the pages hold it (from layer ``position % num_layers``)."""
        size = self.pool.page_size
        b = self.pool.tensor[position % self.num_layers, page_table[position // size], 0, 0, position % size, :3]
        lo, mid, hi = (int(x) for x in b.tolist())
        return lo | mid << 8 | hi << 16

    def _hashes(self, entry: BatchEntry) -> list[int]:
        h = self._hash_at(entry.page_table, entry.start - 1) if entry.start > 0 else SEED
        out = []
        for token in entry.token_ids:
            h = mix(h, token)
            out.append(h)
        return out

    def _where(
        self, entries: list[BatchEntry], hashes: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pages, slots and hash bytes of every position the step writes."""
        size = self.pool.page_size
        pages, slots, values = [], [], []
        for e, hs in zip(entries, hashes):
            for i, h in enumerate(hs):
                p = e.start + i
                pages.append(e.page_table[p // size])
                slots.append(p % size)
                values.append((h & 0xFF, h >> 8 & 0xFF, h >> 16))
        return (
            torch.tensor(pages, dtype=torch.long),
            torch.tensor(slots, dtype=torch.long),
            torch.tensor(values, dtype=self.pool.dtype).reshape(-1, 3),
        )

    def _logits(self, hashes: list[int]) -> torch.Tensor:
        out = torch.full((len(hashes), self.vocab_size), OTHER_LOGIT)
        for i, h in enumerate(hashes):
            out[i, next_token(h, self.vocab_size, self._end)] = 0.0
        return out
