"""The seams of the engine layer, typed: what a serving worker or a KV connector may ask of an
engine (:class:`Engine`), what it learns about the model and the KV cache (:class:`ModelDims`,
:class:`KVCacheSpec`), and what the engine tells a KV connector while it runs
(:class:`KVStepListener`, with a :class:`DeviceMark` that says when the device has really
written what a step queued). ``LLMEngine`` (the torch engine) implements :class:`Engine`; a
TensorRT-LLM engine would implement the same protocol in its own module."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from backend.engine.cache_summary import CacheSummary
from backend.engine.outputs import EngineOutput, ErrorKind
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import StepBatch

if TYPE_CHECKING:
    import torch

    from backend.engine.kv_pool import KVPool


@dataclass
class BatchEntry:
    """One sequence's share of a step: tokens at positions ``start .. start+len(token_ids)-1``."""

    token_ids: list[int]
    start: int
    page_table: list[int]


@dataclass
class StepResult:
    logits: torch.Tensor  # [num_entries, vocab]: logits of each entry's last scheduled token
    hidden: torch.Tensor  # [num_entries, hidden]: final hidden state (after the final norm) there
    # with run(..., num_logits=n): per entry, its last n[i] positions: [n[i], vocab] / [n[i], hidden]
    position_logits: list[torch.Tensor] | None = None
    position_hidden: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class ModelDims:
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_kv_heads: int  # of the whole model (all TP shards)
    head_dim: int


@dataclass(frozen=True)
class KVCacheSpec:
    """The instance's paged HND KV cache: per TP rank one tensor
    ``[num_layers, num_pages, 2, num_kv_heads / tp_size, page_size, head_dim]``."""

    model: str
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tp_size: int
    device_type: str  # "cpu" or "cuda"
    shards: tuple[torch.Tensor, ...]

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shards)


class DeviceMark(Protocol):
    """A point in the device's queue of work: done once the device has executed everything
    queued before the mark was made (on the CPU: at once). See ``device_progress.py``."""

    def done(self) -> bool: ...
    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until done; False if ``timeout_s`` passed first."""


class Runner(Protocol):
    """What the engine drives: the model (``model_runner.py``; a tensor-parallel lead in
    ``backend/parallel/``; the emulated engine's stand-in, ``emulated_runner.py``) and its KV pool."""

    pool: KVPool
    device: torch.device
    vocab_size: int

    def run(
        self, entries: list[BatchEntry], hook_arg: object = None, num_logits: list[int] | None = None
    ) -> StepResult:
        """One step over ``entries``; ``num_logits[i]``: how many trailing positions of entry i need
        logits (default: its last); the layer hook fires as each layer's KV write is queued."""

    def set_layer_hook(self, hook: Callable[[int, Any, DeviceMark], None] | None) -> None: ...
    def device_mark(self) -> DeviceMark: ...
    def dims(self) -> ModelDims: ...
    def shard_pools(self) -> list[torch.Tensor]: ...
    def end_token_ids(self) -> tuple[int, ...]: ...
    def health(self) -> str | None: ...
    def add_failure_callback(self, callback: Callable[[str], None]) -> None: ...
    def close(self) -> None: ...


class KVStepListener(Protocol):
    """Worker side of a KV connector, as the engine calls it (engine thread)."""

    def step_scheduled(self, batch: StepBatch) -> None:
        """Before a step with prefill-only chunks runs: which chunks it computes."""

    def layer_written(self, layer: int, batch: StepBatch, written: DeviceMark) -> None:
        """Each layer of such a step has *queued* its KV write into the pool (TP: on every rank);
        ``written`` is done once the device has executed it. The listener must not let anything
        read the layer's pages before then, and must not block the engine thread waiting."""


class KVLoader(Protocol):
    """Scheduler side of a receiving KV connector, as the engine calls it (engine thread)."""

    def load(self, req_id: str, token_ids: list[int], page_table: list[int], cached_tokens: int) -> bool:
        """A ``remote_kv`` request was admitted with its pages (``page_table``; the first
        ``cached_tokens`` of ``token_ids`` were in the prefix cache). True: its prompt's KV (all
        tokens but the last) will be loaded into those pages from elsewhere; the request waits
        until :meth:`Engine.kv_loaded`, or :meth:`Engine.fail` ends it (its pages held until
        :meth:`Engine.release`: a late write may land). False: the engine computes the
        uncached part itself. Must not block (queue the work, return)."""


class Engine(Protocol):
    max_model_len: int
    default_end_ids: tuple[int, ...]  # the model's end-of-sequence tokens (a request may name its own)

    # requests (the engine loop thread calls these)
    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        prefill_only: bool = False,
        remote_kv: bool = False,
    ) -> None: ...
    def abort(self, req_id: str) -> EngineOutput | None: ...
    def kv_loaded(self, req_id: str, hidden: torch.Tensor | None = None, logits: torch.Tensor | None = None) -> bool:
        """A request waiting for remote KV has it (with the prefill's last hidden state and
        logits, if sent): it runs its last prompt token next. False if it is not waiting."""

    def compute_here(self, req_id: str) -> bool:
        """A request waiting for remote KV will not get it (its load failed, and no write can
        land any more): compute the uncached part of its prompt here, with the pages it holds.
        False if it is not waiting."""

    def step(self) -> list[EngineOutput]: ...
    def has_work(self) -> bool: ...
    def set_waker(self, waker: Callable[[], None]) -> None:
        """``waker()`` (from another thread) when work arrives that no command brought (a KV tier
        load finished): a loop waiting for a command should step again."""

    def stalled(self) -> bool:
        """The last step found nothing it could run: wait for a command before stepping again."""

    def fail(self, req_ids: list[str], message: str, kind: ErrorKind = ...) -> list[EngineOutput]: ...
    def active_request_ids(self) -> list[str]: ...
    def queue_lengths(self) -> tuple[int, int]: ...

    def release(self, req_id: str) -> int:
        """Free the pages a finished request still holds (``EngineOutput.pages_held``)."""

    # pages (thread-safe reads)
    def page_table(self, req_id: str) -> list[int]: ...
    def pool_stats(self) -> dict: ...
    def cache_summary(self) -> CacheSummary:
        """Which pages the prefix cache holds (64-bit keys of their hashes) and the load, for routers."""

    # the model, the KV cache, health
    def dims(self) -> ModelDims: ...
    def kv_cache(self) -> KVCacheSpec: ...
    def set_kv_listener(self, listener: KVStepListener | None, layer_events: bool = True) -> None: ...
    def set_kv_loader(self, loader: KVLoader | None) -> None: ...
    def device_mark(self) -> DeviceMark:
        """Done once the device has run everything queued so far (e.g. a finished step's hidden
        state and logits)."""

    def health(self) -> str | None: ...
    def on_out_of_service(self, callback: Callable[[str], None]) -> None: ...
    def close(self) -> None: ...
