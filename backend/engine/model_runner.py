"""Loads a transformers causal LM and runs packed steps with attention over our paged KV pool
(through the lean layer loop of ``lean_decoder.py`` where the checkpoint's layers fit it)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from backend.engine.config import EngineConfig
from backend.engine.device_progress import DeviceProgress, make_progress
from backend.engine.formats import kernel_path_line, weight_format
from backend.engine.fp16_linear import fp16_max_rows, many_rows_dtype, quantize_linear_fp16
from backend.engine.fused_decode import FusedDecode
from backend.engine.fused_decode import unsupported_reason as fused_unsupported
from backend.engine.group_matmul import f32_unsupported
from backend.engine.int4_linear import quantize_linear_int4
from backend.engine.int8_group_linear import quantize_lm_head_int8
from backend.engine.kv_pool import KVPool
from backend.engine.lean_decoder import LeanDecoder, fuse_projections, unsupported_reason
from backend.engine.paged_attention import ATTN_IMPLEMENTATION, build_paged_batch
from backend.engine.protocol import BatchEntry, DeviceMark, ModelDims, StepResult
from backend.engine.small_batch_linear import use_small_batch_linears

log = logging.getLogger("triton_disagg.engine")

__all__ = ["ModelRunner"]

# torch's thread count when this module was imported: what a runner without num_threads uses (a
# runner built after another one's few-row step must not read that step's single thread)
_PROCESS_THREADS = torch.get_num_threads()


class ModelRunner:
    """Owns the model and the KV pool. ``on_layer_kv_written(layer_idx, hook_arg)`` fires inside
    each layer right after that layer's K/V write for the step is queued; the hook set with
    :meth:`set_layer_hook` gets a :class:`DeviceMark` with it. ``progress``: how the runner
    tells when the device has executed what it queued (default: by its device, see
    ``device_progress.py``; a test passes a stand-in). A subclass that changes the model's layers
    after loading (tensor parallel shards) sets ``lean_layers = False``: transformers' modules run."""

    lean_layers = True

    def __init__(self, config: EngineConfig, progress: DeviceProgress | None = None):
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self._threads = config.num_threads or _PROCESS_THREADS
        torch.set_num_threads(self._threads)
        model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=self.dtype)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        # transformers wraps PreTrainedModel.to with functools.wraps, whose typeshed type does not bind self
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        self.decoder = self._choose_decoder(config)
        if self.decoder == "lean":
            fuse_projections(self.model)  # before quantization, which then covers the fused layers
        # fp16w, fp16w-bf16: a step whose products all take the float16 weights (fbgemm's GEMM, one
        # thread) runs on one torch thread; a second one only spins beside it and slows the step
        # (one stream through the server, 2 cores: 31.8 tok/s on 1 thread, 27.3 on 2). Steps with
        # more rows (prefill chunks) keep every thread for their float32 or bfloat16 products.
        self._few_rows = 0
        fmt = weight_format(config.weights_format)  # its entry says which kernels take its products
        if fmt.many_dtype is not None:  # fbgemm's own products: no small-batch linears on top
            many_rows = many_rows_dtype(fmt.name)
            self._few_rows = fp16_max_rows(self._threads)
            if fmt.groups:  # the decoder layers in 4-bit groups, the LM head in 8-bit ones
                # our kernel splits a product between the instance's threads (fbgemm's GEMM cannot)
                self.model = quantize_linear_int4(self.model, self._few_rows, many_rows, self._threads)
                self.model = quantize_lm_head_int8(self.model, self._few_rows, many_rows, self._threads)
            self.model = quantize_linear_fp16(self.model, self._few_rows, fmt.name, self._threads)
            log.info(
                "%s weights: %s for products of up to %d rows (on one thread), %s beyond (on %d threads)",
                fmt.name,
                "int4 groups (the LM head int8 groups)" if fmt.groups else "float16",
                self._few_rows,
                fmt.many_dtype,
                self._threads,
            )
        elif self.device.type == "cpu":
            use_small_batch_linears(self.model)
        if self.device.type == "cpu":
            log.info("%s", kernel_path_line(fmt.name))
            if fmt.few_rows in ("f32", "f16") and f32_unsupported() is not None:
                log.warning(
                    "%s products through torch's kernels: our kernel library is unavailable (%s)",
                    fmt.name,
                    f32_unsupported(),
                )
        hf_config = model.config
        self.hf_config = hf_config
        self.vocab_size = hf_config.vocab_size
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        self.pool = self._make_pool(config, head_dim)
        self.on_layer_kv_written: Callable[[int, object], None] | None = None
        self.progress = progress if progress is not None else make_progress(self.device)
        self._lean = LeanDecoder(self.model) if self.decoder == "lean" else None
        self._fused: FusedDecode | None = None
        if self._lean is not None and config.decoder == "auto" and fmt.fused is not None:
            reason = fused_unsupported(self.model, self.pool, fmt.fused)
            if reason is None:
                self._fused = FusedDecode(self.model, self.pool, fmt.fused, self._threads)
                self.decoder = "lean+fused"
            else:
                log.info("decode steps through the lean layer loop (one kernel call does not apply: %s)", reason)
        assert config.num_pages is not None  # set by EngineConfig.__post_init__
        log.info(
            "engine model=%s type=%s layers=%d device=%s weights=%s decoder=%s; KV pool %d pages x %d tokens "
            "= %d tokens, %.1f MiB (%s)%s",
            config.model_path,
            hf_config.model_type,
            hf_config.num_hidden_layers,
            self.device,
            config.weights_format + (f" (auto: {config.weights_choice})" if config.weights_choice else ""),
            self.decoder,
            config.num_pages,
            config.page_size,
            config.num_pages * config.page_size,
            self.pool.total_bytes / 2**20,
            self.pool.layout(),
            f"; {config.kv_format} KV (auto: {config.kv_choice})" if config.kv_choice else "",
        )

    def _choose_decoder(self, config: EngineConfig) -> str:
        """``lean`` or ``transformers`` (see ``EngineConfig.decoder``)."""
        if config.decoder == "transformers" or not self.lean_layers:
            return "transformers"
        reason = unsupported_reason(self.model)
        if reason is not None:
            log.info("decoder: transformers' modules (the lean layer loop does not fit: %s)", reason)
            return "transformers"
        return "lean"

    def _make_pool(self, config: EngineConfig, head_dim: int) -> KVPool:
        """The KV pool this runner attends over (a tensor-parallel rank overrides it with its shard)."""
        hf_config = self.hf_config
        assert config.num_pages is not None  # set by EngineConfig.__post_init__
        return KVPool(
            num_layers=hf_config.num_hidden_layers,
            num_pages=config.num_pages,
            num_kv_heads=hf_config.num_key_value_heads,
            page_size=config.page_size,
            head_dim=head_dim,
            dtype=config.kv_torch_dtype,
            device=self.device,
        )

    def dims(self) -> ModelDims:
        hf = self.hf_config
        return ModelDims(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            vocab_size=self.vocab_size,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=self.pool.head_dim,
        )

    def set_layer_hook(self, hook: Callable[[int, Any, DeviceMark], None] | None) -> None:
        """``hook(layer_idx, hook_arg, written)`` runs right after each layer queued the step's KV
        write; ``written`` is done once the device has executed it. ``hook_arg`` is what the caller
        passed to :meth:`run` (opaque here, hence ``Any``)."""
        if hook is None:
            self.on_layer_kv_written = None
            return
        progress = self.progress

        def fire(layer_idx: int, hook_arg: object) -> None:
            hook(layer_idx, hook_arg, progress.mark())

        self.on_layer_kv_written = fire

    def device_mark(self) -> DeviceMark:
        """Done once the device has executed everything queued so far."""
        return self.progress.mark()

    def shard_pools(self) -> list[torch.Tensor]:
        """Every TP rank's KV pool tensor, in rank order (here: the one pool)."""
        return [self.pool.tensor]

    def health(self) -> str | None:
        """None: serving. A single-process runner has no part that can be lost."""
        return None

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Nothing to watch in a single process (a TP lead calls these when it loses a rank)."""

    def close(self) -> None:
        """Nothing to stop in a single process."""

    def end_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the checkpoint's generation config (falls back to the model config)."""
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.hf_config.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    @torch.inference_mode()
    def run(
        self, entries: list[BatchEntry], hook_arg: object = None, num_logits: list[int] | None = None
    ) -> StepResult:
        """``num_logits[i]``: how many trailing positions of entry i need logits (speculative
        verification); default: only each entry's last position."""
        batch = build_paged_batch(entries, self.pool, self.device)
        if self._few_rows:
            torch.set_num_threads(1 if batch.input_ids.numel() <= self._few_rows else self._threads)
        batch.on_layer_kv_written = self.on_layer_kv_written
        batch.hook_arg = hook_arg
        # a decode step as one kernel call, where it takes the step (else None)
        states = self._fused.forward(batch) if self._fused is not None else None
        if states is None and self._lean is not None:
            states = self._lean.forward(batch)
        elif states is None:
            states = self.model.model(
                input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, paged_batch=batch
            ).last_hidden_state[0]
        if num_logits is None:
            hidden = states.index_select(0, batch.last_token_index)
            return StepResult(logits=self.model.lm_head(hidden), hidden=hidden)
        index = torch.cat(
            [torch.arange(last - n + 1, last + 1) for last, n in zip(batch.last_token_index.tolist(), num_logits)]
        ).to(self.device)
        hidden = states.index_select(0, index)
        logits = self.model.lm_head(hidden)
        ends = torch.tensor(num_logits, device=self.device).cumsum(0) - 1
        return StepResult(
            logits=logits[ends],
            hidden=hidden[ends],
            position_logits=list(logits.split(num_logits)),
            position_hidden=list(hidden.split(num_logits)),
        )
