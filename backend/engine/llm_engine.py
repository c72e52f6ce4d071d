"""LLMEngine: synchronous continuous-batching engine (scheduler + model runner + sampler).

Roles:
- aggregated: ``add_request(req_id, prompt, params)`` then ``step()`` until finished;
- prefill: ``add_request(..., prefill_only=True)`` computes the prompt in chunks and never samples;
  its final output carries the last position's hidden state and logits; its pages stay held until
  ``release(req_id)`` (a KV transfer may still read them), whatever the finish reason;
- decode: ``add_request(..., remote_kv=True)`` is admitted like any request (pages, its cached
  prefix first); the KV loader (``set_kv_loader``) then decides whether the rest of the prompt's
  KV comes from elsewhere; if so the request waits, holding its pages, until ``kv_loaded(req_id,
  hidden, logits)`` starts it at its last prompt token (with the prefill's last hidden state and
  logits if sent) or ``fail`` ends it (pages held until ``release``: a late write may land).

KV tiers (``kv_tiers.py``): blocks of a prompt's prefix that the host or disk tier holds are
copied into the request's pages on the tiers' loader thread while the engine steps the others
(the request waits in ``WAITING_TIER_KV``); each step first folds in the loads that finished. A
request ended while its load runs keeps its pages until the load is done (then they are freed).
A request whose prefix the shared tier may hold first waits, holding nothing, while the store is
asked on the tiers' lookup thread (``WAITING_TIER_LOOKUP``, at most ``LOOKUP_WAIT_S``): no step
ever waits on the store.

Decode side (aggregated and decode roles): speculative decoding (a decoding sequence runs its
last token plus draft tokens in one chunk; the accepted drafts and one target token are
appended, the rejected ones rolled back: ``num_computed`` and pages) and grammar-constrained
sampling, both per request (``SamplingParams``; see ``backend/engine/sampling/decode_sampler.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

import torch

from backend.engine.cache_summary import CacheSummary
from backend.engine.checkpoint_source import checkpoint_identity
from backend.engine.config import EngineConfig
from backend.engine.disk_tier import DiskTier
from backend.engine.file_reader import FileReader
from backend.engine.kv_block import BlockCodec, layout_digest
from backend.engine.kv_tiers import KVTiers, TierLoad
from backend.engine.outputs import EngineOutput, ErrorKind, FinishReason, TokenLogprobs
from backend.engine.page_allocator import PageAllocator
from backend.engine.protocol import BatchEntry, DeviceMark, KVCacheSpec, KVLoader, KVStepListener, ModelDims, Runner
from backend.engine.sampling.decode_sampler import DecodeSampler
from backend.engine.sampling.logprobs import token_logprobs
from backend.engine.sampling.sampler import make_generator, sample
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import ChunkInfo, ScheduledChunk, Scheduler, StepBatch
from backend.engine.sequence import SeqStatus, Sequence
from backend.engine.shared_tier import BlockStore, SharedTier

log = logging.getLogger("triton_disagg.engine")

TIER_WAIT_S = 0.05  # a step with nothing to run but tier loads waits this long for one at most
LOOKUP_WAIT_S = 1.0  # a request waits this long at most for the shared tier's answer, then queues


def make_runner(config: EngineConfig) -> Runner:
    """The runner of a one-process instance: the model's, or the emulated engine's (which loads no
    model: its module imports no transformers)."""
    if config.emulate:
        from backend.engine.emulated_runner import EmulatedRunner

        return EmulatedRunner(config)
    from backend.engine.model_runner import ModelRunner

    return ModelRunner(config)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        runner: Runner | None = None,
        store: BlockStore | None = None,
        disk_reader: Callable[[], FileReader | None] | None = None,
    ):
        """``runner``: the model runner to drive (a tensor-parallel lead is built by
        ``backend.parallel.engine_factory.build_engine``); default: a plain ``ModelRunner``, or
        with ``config.emulate`` the emulated engine's ``EmulatedRunner``.
        ``store``: the shared KV tier's store (``config.kv_store_url``'s, built by the serving
        layer), or None. ``disk_reader``: builds what the disk tier reads its files with, called
        only when there is one (the serving layer's, from ``config.kv_disk_reader``; None, or
        it returning None: plain file I/O)."""
        self.config = config
        self.max_model_len = config.resolve_max_model_len()
        if runner is None:
            if config.tensor_parallel_size != 1:
                raise ValueError(
                    "tensor_parallel_size > 1: build the engine with backend.parallel.engine_factory.build_engine"
                )
            runner = make_runner(config)
        self.runner = runner
        assert config.num_pages is not None  # EngineConfig resolves it from kv_cache_tokens
        salt = self._cache_salt()
        self.tiers = self._build_tiers(salt, store, disk_reader)
        self.allocator = PageAllocator(
            config.num_pages, config.page_size, prefix_caching=config.enable_prefix_caching, salt=salt, tiers=self.tiers
        )
        self.scheduler = Scheduler(
            self.allocator, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len
        )
        if self.tiers is not None:
            self.scheduler.load_tiers = self._load_tiers
        self._orphans: set[str] = set()  # ended while their tier load ran: freed when it is done
        self._lookups: dict[str, float] = {}  # request -> since when the shared tier is asked for it
        self.default_end_ids = self.runner.end_token_ids()
        self.kv_listener: KVStepListener | None = None
        self.kv_loader: KVLoader | None = None
        self._seqs: dict[str, Sequence] = {}
        self.decode_sampler = DecodeSampler(self.max_model_len)

    @property
    def pool(self):
        return self.runner.pool

    def _cache_salt(self) -> bytes:
        """What makes two instances' pages for the same tokens hold the same KV."""
        c = self.config
        return (
            f"{checkpoint_identity(c.model_path)}|w{c.weights_format}|kv{c.kv_format}"
            f"|tp{c.tensor_parallel_size}|ps{c.page_size}"
        ).encode()

    def _build_tiers(
        self, salt: bytes, store: BlockStore | None, reader: Callable[[], FileReader | None] | None
    ) -> KVTiers | None:
        """The KV tiers below the pool, or None (no prefix caching, no tier configured, or a pool
        held by more than one process: a TP instance's pages are in its ranks)."""
        c = self.config
        assert c.kv_host_tokens is not None
        host_blocks = c.kv_host_tokens // c.page_size
        if not c.enable_prefix_caching or (host_blocks == 0 and c.kv_disk_bytes == 0 and store is None):
            return None
        if c.tensor_parallel_size != 1:
            log.info(
                "KV tiers: off (tensor_parallel_size %d: the pool is split between processes)", c.tensor_parallel_size
            )
            return None
        pool = self.pool
        block_shape = (pool.num_layers, 2, pool.num_kv_heads, pool.page_size, pool.head_dim)
        disk = None
        if c.kv_disk_bytes > 0:
            try:
                disk = DiskTier(
                    c.disk_tier_folder,
                    c.kv_disk_bytes,
                    salt,
                    pool.layout(),
                    block_shape,
                    pool.dtype,
                    reader() if reader is not None else None,
                )
            except OSError as e:
                log.warning("KV tiers: no disk tier (%s: %s)", c.disk_tier_folder, e)
        codec = BlockCodec(layout_digest(salt, pool.layout()), block_shape, pool.dtype)
        shared = SharedTier(store, codec) if store is not None else None
        tiers = KVTiers(pool, host_blocks, disk, c.kv_disk_admit_hits, shared)
        log.info(
            "KV tiers: host %d blocks of %d tokens; disk %s; shared %s",
            host_blocks,
            c.page_size,
            f"{c.kv_disk_bytes} bytes in {disk.folder}, blocks hit {c.kv_disk_admit_hits}+ times, read with "
            f"{disk.reader.name}"
            if disk
            else "none",
            store.describe() if store is not None else "none",
        )
        return tiers

    def set_waker(self, waker: Callable[[], None]) -> None:
        """``waker()`` is called (from another thread) when the engine has new work that no command
        brought: a tier load finished."""
        if self.tiers is not None:
            self.tiers.waker = waker

    def _load_tiers(self, seq: Sequence) -> None:
        assert self.tiers is not None
        loads = [TierLoad(page, key, block) for page, key, block in self.allocator.tier_loads(seq.req_id)]
        self.tiers.load(seq.req_id, loads)

    def _fold_tier_loads(self) -> None:
        """The tier loads that finished: their requests go on (or, ended meanwhile, free their pages)."""
        if self.tiers is None:
            return
        now = time.monotonic()
        answered = self.tiers.looked_up()
        late = [r for r, since in self._lookups.items() if now - since > LOOKUP_WAIT_S]
        for req_id in answered + late:
            if self._lookups.pop(req_id, None) is None:
                continue
            seq = self._seqs.get(req_id)
            if seq is not None and seq.status is SeqStatus.WAITING_TIER_LOOKUP:
                self.scheduler.looked_up(seq)
        for req_id, loaded in self.tiers.finished():
            if req_id in self._orphans:
                self._orphans.discard(req_id)
                if self.allocator.has(req_id):
                    self.allocator.free(req_id)
                continue
            seq = self._seqs.get(req_id)
            if seq is None or seq.status is not SeqStatus.WAITING_TIER_KV:
                continue
            self.allocator.tier_loaded(req_id, loaded)
            self.scheduler.tier_loaded(seq)

    def set_kv_listener(self, listener: KVStepListener | None, layer_events: bool = True) -> None:
        """``listener.step_scheduled(batch)`` before each step with prefill-only chunks; with
        ``layer_events``, ``listener.layer_written(layer, batch, written)`` right after each layer
        queued the step's KV write (``written``: done once the device executed it)."""
        self.kv_listener = listener
        self.runner.set_layer_hook(listener.layer_written if listener is not None and layer_events else None)

    def set_kv_loader(self, loader: KVLoader | None) -> None:
        """``loader.load(...)`` when a ``remote_kv`` request has its pages (see ``KVLoader``)."""
        self.kv_loader = loader
        self.scheduler.load_remote = self._load_remote if loader is not None else None

    def _load_remote(self, seq: Sequence) -> bool:
        assert self.kv_loader is not None
        return self.kv_loader.load(seq.req_id, seq.token_ids, self.allocator.page_table(seq.req_id), seq.num_computed)

    def device_mark(self) -> DeviceMark:
        return self.runner.device_mark()

    # ------------------------------------------------------------ the model, the cache, health
    def dims(self) -> ModelDims:
        return self.runner.dims()

    def kv_cache(self) -> KVCacheSpec:
        pool, shards = self.pool, tuple(self.runner.shard_pools())
        return KVCacheSpec(
            # the weights format is part of what the KV means: peers with other weights refuse it
            model=f"{os.path.basename(os.path.normpath(self.config.model_path))}+{self.config.weights_format}",
            num_layers=pool.num_layers,
            num_pages=pool.num_pages,
            page_size=pool.page_size,
            num_kv_heads=pool.num_kv_heads * len(shards),
            head_dim=pool.head_dim,
            dtype=str(pool.dtype).removeprefix("torch."),
            tp_size=len(shards),
            device_type=pool.tensor.device.type,
            shards=shards,
        )

    def health(self) -> str | None:
        """None while the instance serves; else why it is out of service for good."""
        return self.runner.health()

    def on_out_of_service(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` once if the instance goes out of service (a TP rank is lost)."""
        self.runner.add_failure_callback(callback)

    def page_table(self, req_id: str) -> list[int]:
        return self.allocator.page_table(req_id)

    def queue_lengths(self) -> tuple[int, int]:
        """(waiting, running) sequences (waiting: queued, or waiting for the tiers' answer or load)."""
        s = self.scheduler
        return len(s.waiting) + len(s.looking_up) + len(s.tier_parked), len(s.running)

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.flush(self.allocator.cached_pages())
            self.tiers.close()
        self.runner.close()

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        prefill_only: bool = False,
        remote_kv: bool = False,
    ) -> None:
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        self._validate(req_id, prompt, params, prefill_only, remote_kv)
        if not params.end_ids and not params.ignore_eos:
            params = dataclasses.replace(params, end_ids=self.default_end_ids)
        seq = Sequence(
            req_id,
            prompt,
            params,
            make_generator(params, self.runner.device),
            prefill_only=prefill_only,
            remote_kv=remote_kv,
        )
        if params.grammar is not None:
            from backend.engine.sampling.grammar import GrammarState  # xgrammar only when used

            seq.grammar = GrammarState(params.grammar)
            try:
                seq.grammar.advance(list(params.grammar_prefix))
            except RuntimeError:
                raise ValueError("the resumed output does not follow the request's grammar") from None
        self._seqs[req_id] = seq
        look_up = (
            self.tiers is not None
            and not seq.wants_prompt_logprobs
            and self.tiers.look_up(req_id, self.allocator.uncached_keys(prompt, params.cache_salt))
        )
        if look_up:
            self._lookups[req_id] = time.monotonic()
        self.scheduler.add(seq, look_up=look_up)

    def abort(self, req_id: str) -> EngineOutput | None:
        """Stop a request now; returns its final output, or None if it is not active."""
        seq = self._seqs.get(req_id)
        if seq is None:
            return None
        return self._finish(seq, FinishReason.ABORT, [])

    def kv_loaded(self, req_id: str, hidden: torch.Tensor | None = None, logits: torch.Tensor | None = None) -> bool:
        """A request waiting for remote KV has it: it runs its last prompt token next (False: it
        is not waiting, e.g. cancelled meanwhile)."""
        seq = self._seqs.get(req_id)
        if seq is None or seq.status is not SeqStatus.WAITING_REMOTE_KV:
            return False
        seq.last_hidden, seq.last_logits = hidden, logits
        self.scheduler.kv_loaded(seq)
        return True

    def compute_here(self, req_id: str) -> bool:
        """A request waiting for remote KV computes its prompt here instead (see ``Engine``)."""
        seq = self._seqs.get(req_id)
        if seq is None or seq.status is not SeqStatus.WAITING_REMOTE_KV:
            return False
        self.scheduler.compute_here(seq)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._tier_work()

    def _tier_work(self) -> bool:
        """Requests wait for the tiers (a lookup, a load) or a load writes pages of an ended one."""
        s = self.scheduler
        return bool(s.tier_parked or s.looking_up or self._orphans)

    def stalled(self) -> bool:
        """The last step found nothing it could run (its queue waits for pages or seats that only
        a command can free): the caller should wait for one rather than step again."""
        return self.scheduler.stalled

    def pool_stats(self) -> dict:
        """The allocator's figures, and the KV tiers' (``tier_*``) when there are tiers."""
        stats = self.allocator.stats()
        if self.tiers is not None:
            stats.update({f"tier_{k}": v for k, v in self.tiers.stats().items()})
        return stats

    def cache_summary(self) -> CacheSummary:
        """The prefix cache's page keys, its tiers' block keys and this engine's load, for
        routers (``cache_summary.py``)."""
        version, keys = self.allocator.cached_keys()
        tiers_version, tier_keys = self.tiers.keys() if self.tiers is not None else (0, frozenset())
        stats = self.allocator.stats()
        waiting, running = self.queue_lengths()
        return CacheSummary(
            self.allocator.salt.hex(),
            self.allocator.page_size,
            version + tiers_version,
            keys,
            stats["total"],
            stats["free"],
            waiting + running,
            0,
            tier_keys,
        )

    def release(self, req_id: str) -> int:
        """Free the pages a finished request still holds (``EngineOutput.pages_held``: a
        prefill-only request, or one that waited for remote KV); returns how many."""
        if req_id in self._seqs:
            raise ValueError(f"request {req_id!r} is still running; abort it first")
        if req_id in self._orphans:  # its tier load still writes them: freed when it is done
            return 0
        return self.allocator.free(req_id) if self.allocator.has(req_id) else 0

    def step(self) -> list[EngineOutput]:
        self.decode_sampler.propose(
            [
                s
                for s in (*self.scheduler.running, *self.scheduler.waiting)
                if s.params.num_draft_tokens and s.num_uncomputed == 1
            ]
        )
        self._fold_tier_loads()
        chunks = self.scheduler.schedule()
        if not chunks and self._tier_work() and self.tiers is not None:
            # nothing else to run: wait a little for a load rather than spin (or sleep a whole
            # command wait: the loader's waker wakes an engine loop too)
            self.tiers.wait(TIER_WAIT_S)
            self._fold_tier_loads()
            chunks = self.scheduler.schedule()
        if not chunks:
            return []
        listener = self.kv_listener
        step_batch = self._step_batch(chunks) if listener is not None else None
        rows = [i for i, c in enumerate(chunks) if c.is_last_chunk and not c.seq.prefill_only]
        speculating = any(c.draft_token_ids for c in chunks)
        scoring = [i for i, c in enumerate(chunks) if self._scores_prompt(c)]
        try:
            if listener is not None and step_batch is not None and step_batch.prefill_only_chunks:
                listener.step_scheduled(step_batch)
            extra = {}
            if speculating or scoring:  # logits of more positions than each entry's last
                extra["num_logits"] = [
                    c.num_tokens if i in scoring else 1 + len(c.draft_token_ids) for i, c in enumerate(chunks)
                ]
            result = self.runner.run(
                [BatchEntry(c.input_token_ids, c.start, c.page_table) for c in chunks], hook_arg=step_batch, **extra
            )
            if scoring:
                self._score_prompts(chunks, scoring, result, speculating)
            new_tokens = self._pick(chunks, rows, result)
        except Exception as exc:
            log.exception("engine step failed; failing its %d request(s)", len(chunks))
            kind = ErrorKind.OUT_OF_SERVICE if self.runner.health() else ErrorKind.ENGINE
            return self.fail([c.seq.req_id for c in chunks], f"{type(exc).__name__}: {exc}", kind)
        outputs = []
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            seq.num_computed += chunk.num_tokens
            self.allocator.register(seq.req_id, seq.token_ids, seq.num_computed)  # full pages -> prefix cache
            if chunk.is_last_chunk and seq.prefill_only:
                outputs.append(
                    self._finish(seq, FinishReason.PREFILL_DONE, [], hidden=result.hidden[i], logits=result.logits[i])
                )
        for i in rows:
            outputs.append(self._append(chunks[i], new_tokens[i], result, i))
        return outputs

    @staticmethod
    def _scores_prompt(chunk: ScheduledChunk) -> bool:
        """The chunk holds prompt positions whose logits give prompt tokens' log-probabilities."""
        seq = chunk.seq
        return seq.wants_prompt_logprobs and chunk.start < seq.num_prompt_tokens - 1

    def _score_prompts(self, chunks: list[ScheduledChunk], scoring: list[int], result, speculating: bool) -> None:
        """Keep the log-probabilities of the prompt tokens that the scoring chunks' positions
        predict (position p predicts token p + 1, up to the last prompt token), then leave
        ``result`` as a step without them would have made it."""
        assert result.position_logits is not None and result.position_hidden is not None
        for i in scoring:
            seq, start = chunks[i].seq, chunks[i].start
            n = min(chunks[i].num_tokens, seq.num_prompt_tokens - 1 - start)
            targets = seq.token_ids[start + 1 : start + 1 + n]
            k = seq.params.prompt_logprobs or 0
            seq.prompt_logprobs.append(token_logprobs(result.position_logits[i][:n], targets, k))
        if speculating:  # the drafts' rows are each entry's trailing ones
            keep = [1 + len(c.draft_token_ids) for c in chunks]
            result.position_logits = [rows[-k:] for rows, k in zip(result.position_logits, keep)]
            result.position_hidden = [rows[-k:] for rows, k in zip(result.position_hidden, keep)]
        else:
            result.position_logits = result.position_hidden = None

    def _pick(self, chunks: list[ScheduledChunk], rows: list[int], result) -> dict[int, list[int]]:
        """New tokens per sampled chunk: one batched sample for plain rows; drafts and grammars
        go through the decode sampler row by row."""
        plain = [i for i in rows if not chunks[i].draft_token_ids and chunks[i].seq.grammar is None]
        picked = {}
        if plain:
            logits = result.logits if len(plain) == len(chunks) else result.logits[plain]
            logits = self._mask_end_ids(logits, [chunks[i].seq for i in plain])
            tokens = sample(logits, [chunks[i].seq.params for i in plain], [chunks[i].seq.generator for i in plain])
            picked = {i: [t] for i, t in zip(plain, tokens)}
        for i in rows:
            if i not in picked:
                logits = result.position_logits[i] if result.position_logits is not None else result.logits[i : i + 1]
                picked[i] = self.decode_sampler.pick(chunks[i], logits)
        return picked

    @staticmethod
    def _mask_end_ids(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Rows whose sequence has not reached ``min_tokens`` cannot sample an end id."""
        rows = [
            (r, s.params.end_ids)
            for r, s in enumerate(seqs)
            if s.params.end_ids and not s.params.ignore_eos and s.num_output_tokens < s.params.min_tokens
        ]
        if not rows:
            return logits
        logits = logits.clone()
        for r, end_ids in rows:
            logits[r, list(end_ids)] = float("-inf")
        return logits

    def _append(self, chunk: ScheduledChunk, tokens: list[int], result, row: int) -> EngineOutput:
        """Append a sampled chunk's accepted drafts + target token (stopping early where a stop
        condition holds), keep the last hidden state, roll back the rejected drafts."""
        seq = chunk.seq
        accepted = len(tokens) - 1
        seq.num_computed += accepted
        if result.position_hidden is not None:
            seq.last_hidden, seq.last_logits = (
                result.position_hidden[row][accepted],
                result.position_logits[row][accepted],
            )
        else:
            seq.last_hidden, seq.last_logits = result.hidden[row], result.logits[row]
        emitted, reason = [], None
        for token in tokens:
            seq.token_ids.append(token)
            emitted.append(token)
            reason = seq.check_stop(self.max_model_len)
            if reason is not None:
                break
        if seq.grammar is not None:
            seq.grammar.advance(emitted)
            if reason is None and seq.grammar.done:
                reason = FinishReason.STOP
        self.decode_sampler.clear(seq)
        logprobs = prompt_logprobs = None
        if seq.params.logprobs is not None:  # never with drafts: one token from this row's logits
            logprobs = token_logprobs(result.logits[row : row + 1], emitted, seq.params.logprobs)
        if seq.wants_prompt_logprobs and seq.num_output_tokens == len(emitted):  # the first output
            prompt_logprobs = self._prompt_logprobs(seq)
        if reason is not None:
            return self._finish(seq, reason, emitted, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        if chunk.draft_token_ids:
            self.allocator.shrink(seq.req_id, seq.num_tokens)
        return EngineOutput(
            seq.req_id,
            emitted,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    @staticmethod
    def _prompt_logprobs(seq: Sequence) -> TokenLogprobs:
        """The prompt tokens' log-probabilities gathered over its chunks (tokens 2..P)."""
        parts, seq.prompt_logprobs = seq.prompt_logprobs, []
        if not parts:  # a one-token prompt: nothing to score
            k = seq.params.prompt_logprobs or 0
            return TokenLogprobs(torch.zeros(0), torch.zeros((0, k), dtype=torch.long), torch.zeros((0, k)))
        return TokenLogprobs.cat(parts)

    def fail(self, req_ids: list[str], message: str, kind: ErrorKind = ErrorKind.ENGINE) -> list[EngineOutput]:
        """Finish the given active requests with finish_reason "error" and free their pages
        (a prefill-only request keeps its pages until ``release``)."""
        return [
            self._finish(self._seqs[r], FinishReason.ERROR, [], error=message, error_kind=kind)
            for r in req_ids
            if r in self._seqs
        ]

    def active_request_ids(self) -> list[str]:
        return list(self._seqs)

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        new_tokens: list[int],
        error: str | None = None,
        hidden: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
        error_kind: ErrorKind | None = None,
        logprobs: TokenLogprobs | None = None,
        prompt_logprobs: TokenLogprobs | None = None,
    ) -> EngineOutput:
        # a transfer may still read (prefill-only) or write (waiting for remote KV) its pages
        loading = seq.status is SeqStatus.WAITING_TIER_KV  # the tier loader still writes its pages
        held = (
            self.allocator.has(seq.req_id)
            and not loading
            and (seq.prefill_only or seq.status is SeqStatus.WAITING_REMOTE_KV)
        )
        if loading:  # freed here once the load is done (nothing else read or wrote them yet)
            self._orphans.add(seq.req_id)
        self.scheduler.remove(seq)
        seq.finish_reason = reason
        del self._seqs[seq.req_id]
        if not held and not loading and self.allocator.has(seq.req_id):
            self.allocator.free(seq.req_id)
        return EngineOutput(
            seq.req_id,
            new_tokens,
            finished=True,
            finish_reason=reason,
            error=error,
            error_kind=error_kind,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            hidden_state=hidden,
            logits=logits,
            pages_held=held,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _step_batch(self, chunks: list[ScheduledChunk]) -> StepBatch:
        page_size = self.config.page_size
        return StepBatch(
            [
                ChunkInfo(
                    c.seq.req_id,
                    c.start,
                    c.num_tokens,
                    c.touched_page_ids(page_size),
                    c.is_last_chunk,
                    c.seq.prefill_only,
                )
                for c in chunks
            ]
        )

    def _validate(
        self, req_id: str, prompt: list[int], params: SamplingParams, prefill_only: bool, remote_kv: bool
    ) -> None:
        if req_id in self._seqs:
            raise ValueError(f"request {req_id!r} is already active")
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        vocab = self.runner.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt must leave room for one more token)"
            )
        if params.max_tokens > self.config.max_tokens_limit:
            raise ValueError(f"max_tokens {params.max_tokens} exceeds the limit {self.config.max_tokens_limit}")
        probe = Sequence(req_id, prompt, params, None, prefill_only=prefill_only)
        needed = self.allocator.pages_for(probe.kv_tokens_needed(self.max_model_len))
        if needed > self.allocator.num_pages:
            raise ValueError(f"request needs up to {needed} KV pages; the pool has {self.allocator.num_pages}")
        if prefill_only and (params.grammar is not None or params.num_draft_tokens):
            raise ValueError("a prefill-only request never samples: no grammar or draft tokens")
        if remote_kv and prefill_only:
            raise ValueError("remote_kv and prefill_only are exclusive")
        if self.allocator.has(req_id):
            raise ValueError(f"request {req_id!r} still holds pages (reserved or unreleased)")
