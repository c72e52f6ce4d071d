"""Tensor-parallel model runner: one engine instance as ``tensor_parallel_size`` rank processes.

Who does what: the instance's own process (the Triton model instance, or a test) is rank 0,
the *lead*. It keeps the single scheduler and page allocator (the ``LLMEngine``), creates
every rank's KV shard pool in shared memory (``backend/parallel/shm_pools.py``), starts ranks
1..t-1 as child processes (``backend/parallel/rank.py``) and, each step, sends them the step's
batch (token ids, positions, page tables as :class:`BatchEntry` lists) before running its own
shard of the forward. All ranks run the same forward over their heads and MLP slice
(``backend/parallel/shards.py``); the lead samples. The lead also maps all shard pools, so one fabric
agent per instance registers them as its TP shards and posts every write.

Layer hook: on a TP instance the per-layer hook fires on the lead after the layer's o_proj
all-reduce has been queued, not inside the attention function. Its device mark is queued on
the lead's stream after that all-reduce, which completes only once every rank has reached it,
each after its own KV write (stream order): when the mark is done, every rank's shard holds
the layer's KV. On CPU (gloo) the all-reduce returns when it is done and so does the write.

Failure: if a rank process exits or a collective fails, the instance is out of service for
good: the running step fails, every later step fails at once with the reason, the other
ranks are stopped, and ``on_failure`` callbacks run (a prefill worker stops taking work).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from collections.abc import Callable

from backend.engine.config import EngineConfig
from backend.engine.protocol import BatchEntry, StepResult
from backend.parallel.comm import host_store, join_group
from backend.parallel.processes import RankProcesses
from backend.parallel.rank_runner import GROUP_TIMEOUT_S, TPModelRunner, rank_device
from backend.parallel.shards import LayerSignal, check_shardable
from backend.parallel.shm_pools import SharedShards

log = logging.getLogger("triton_disagg.engine")


class TPInstanceDown(RuntimeError):
    """A tensor-parallel instance lost a rank; it serves nothing more."""


class TPLeadRunner(TPModelRunner):
    """Rank 0 (see module docstring)."""

    def __init__(self, config: EngineConfig):
        from transformers import AutoConfig

        world = config.tensor_parallel_size
        hf = AutoConfig.from_pretrained(config.model_path)
        check_shardable(hf, world)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        assert config.num_pages is not None  # set by EngineConfig.__post_init__
        shape = (hf.num_hidden_layers, config.num_pages, 2, hf.num_key_value_heads // world, config.page_size, head_dim)
        shards = SharedShards(shape, config.kv_torch_dtype, [rank_device(config, r) for r in range(world)])
        self._shard_tensors = list(shards.tensors)
        self._on_failure: list[Callable[[str], None]] = []
        self.failed: str | None = None
        self._fail_lock = threading.Lock()
        store = host_store(world)
        prefix = uuid.uuid4().hex
        self.ranks = RankProcesses(config.settings(), world, store.port, prefix, shards.handles)
        self.ranks.watch(self._fail)
        try:
            group = join_group(store, store.port, 0, world, rank_device(config, 0), prefix, GROUP_TIMEOUT_S)
            shards.unlink()  # every rank has mapped its shard before joining
            self.signal = LayerSignal()
            super().__init__(
                dataclasses.replace(config, device=str(rank_device(config, 0))),
                0,
                world,
                group,
                shards.tensors[0],
                self.signal,
            )
        except BaseException:
            shards.unlink()
            self.ranks.stop()
            raise
        self._store = store  # the rendezvous store lives as long as the group
        log.info(
            "tensor-parallel instance: %d ranks (lead pid + %s), KV shard pools in shared memory, "
            "%d KV head(s) per rank",
            world,
            self.ranks.pids(),
            shape[3],
        )

    def shard_pools(self) -> list:
        return list(self._shard_tensors)

    def health(self) -> str | None:
        return self.failed

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        self._on_failure.append(callback)

    def run(
        self, entries: list[BatchEntry], hook_arg: object = None, num_logits: list[int] | None = None
    ) -> StepResult:
        if self.failed:
            raise TPInstanceDown(self.failed)
        hook = self.on_layer_kv_written
        try:
            self.ranks.send(("step", entries, {"num_logits": num_logits}))
            self.signal.hook, self.signal.arg = hook, hook_arg
            self.on_layer_kv_written = None  # fired by the o_proj reduction instead
            return super().run(entries, hook_arg, num_logits)
        except Exception as exc:
            # ranks may now be out of step: the whole instance goes out of service
            self._fail(self.ranks.exit_reason(wait_s=1.0) or f"step failed: {type(exc).__name__}: {exc}")
            raise TPInstanceDown(self.failed) from exc
        finally:
            self.on_layer_kv_written = hook
            self.signal.hook = self.signal.arg = None

    def _fail(self, reason: str) -> None:
        """First caller: mark the instance failed, run the callbacks, stop the ranks; a concurrent
        caller (watcher vs failing step) returns only after that is done."""
        with self._fail_lock:
            if self.failed:
                return
            self.failed = f"tensor-parallel instance out of service: {reason}"
            log.error("%s", self.failed)
            for cb in self._on_failure:
                try:
                    cb(self.failed)
                except Exception:
                    log.exception("TP failure callback raised")
            self.ranks.stop()

    def close(self) -> None:
        """Stop the other ranks (normal shutdown)."""
        with self._fail_lock:
            self.failed = self.failed or "tensor-parallel instance closed"
        self.ranks.stop()
