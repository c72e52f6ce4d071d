"""Measures an :class:`EngineProfile` on the real engine: steps of known composition (decode
batches, prefill chunks, mixes) timed per thread count, and the co-run slowdown of a decode
step while another process prefills on the machine's other cores.

Prompts are random token ids, distinct per request, so the prefix cache never shortens a step.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass

import torch

from backend.engine.config import EngineConfig
from backend.engine.formats import kernel_path_line
from backend.engine.llm_engine import LLMEngine
from backend.engine.sampling_params import SamplingParams
from backend.engine.step_profile import EngineProfile, StepSample, ThreadProfile

log = logging.getLogger("triton_disagg.planner")

DEFAULT_HANDOFF_S = 0.01  # KV transfer tail + messenger notices on one machine (perf.bench_ttft: 1.4-10 ms tail)


@dataclass(frozen=True)
class Grid:
    """What to time: decode batch sizes x contexts, whole-prompt prefills, chunked prefills of
    ``chunked_prompt`` tokens at each budget in ``chunk_budgets`` (chunks at rising contexts),
    mixes of decoding sequences and a prefill, and steps per decode point."""

    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    decode_contexts: tuple[int, ...] = (64, 512)
    prefills: tuple[int, ...] = (32, 64, 128, 256, 512)
    chunk_budgets: tuple[int, ...] = (64, 256)
    chunked_prompt: int = 768
    mixes: tuple[tuple[int, int], ...] = ((2, 64), (2, 256), (8, 64), (8, 256))  # (decoding seqs, prompt)
    mix_context: int = 256
    steps: int = 4


SMALL_GRID = Grid((1, 4), (16, 64), (16, 64), (16,), 48, ((2, 16),), 32, 2)


class _Bench:
    """One engine whose steps are timed; ``budget`` is its per-step token budget."""

    def __init__(self, model_path: str, threads: int, weights_dtype: str, budget: int, kv_tokens: int = 32768):
        self.engine = LLMEngine(
            EngineConfig(
                model_path=model_path,
                num_threads=threads,
                weights_dtype=weights_dtype,
                kv_cache_tokens=kv_tokens,
                max_num_batched_tokens=budget,
                max_num_seqs=64,
                max_model_len=2048,
                enable_prefix_caching=False,
                device="cpu",
            )
        )
        self.vocab = self.engine.dims().vocab_size
        self.n = 0

    def add(self, length: int, max_tokens: int = 512, prefill_only: bool = False) -> None:
        self.n += 1
        ids = torch.randint(10, self.vocab, (length,), generator=torch.Generator().manual_seed(self.n)).tolist()
        self.engine.add_request(f"p{self.n}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), prefill_only)

    def timed_step(self) -> float:
        start = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - start

    def clear(self) -> None:
        for rid in list(self.engine.active_request_ids()):
            self.engine.abort(rid)
        while self.engine.has_work():
            self.engine.step()


def measure_threads(model_path: str, threads: int, weights_dtype: str, grid: Grid) -> ThreadProfile:
    samples: list[StepSample] = []
    b = _Bench(model_path, threads, weights_dtype, budget=32768)
    for _ in range(2):  # warm-up
        b.add(32, max_tokens=2)
        b.clear()
    for ctx in grid.decode_contexts:
        for batch in grid.decode_batches:
            for _ in range(batch):
                b.add(ctx, max_tokens=grid.steps + 2)
            b.engine.step()  # every prompt in one step, first tokens sampled
            for j in range(grid.steps):
                samples.append(StepSample([(1, ctx + j)] * batch, b.timed_step()))
            b.clear()
    for n in grid.prefills:
        b.add(n + 1, prefill_only=True)  # a prefill computes all prompt tokens but the last
        samples.append(StepSample([(n, 0)], b.timed_step()))
        b.clear()
    for batch, n in grid.mixes:
        for _ in range(batch):
            b.add(grid.mix_context, max_tokens=8)
        b.engine.step()
        b.add(n + 1, prefill_only=True)
        samples.append(StepSample([(1, grid.mix_context)] * batch + [(n, 0)], b.timed_step()))
        b.clear()
    b.engine.close()
    for budget in grid.chunk_budgets:
        b = _Bench(model_path, threads, weights_dtype, budget=budget)
        b.add(grid.chunked_prompt + 1, prefill_only=True)
        for start in range(0, grid.chunked_prompt, budget):
            samples.append(StepSample([(min(budget, grid.chunked_prompt - start), start)], b.timed_step()))
        b.clear()
        b.engine.close()
    prof = ThreadProfile(threads, samples)
    errs = prof.cost.relative_errors(samples)
    log.info(
        "%d thread(s): %d steps timed, coefficients (ms) %s, mean fit error %.1f%%",
        threads,
        len(samples),
        [round(c * 1e3, 3) for c in prof.cost.coef],
        100 * statistics.fmean(errs),
    )
    return prof


def _prefill_loop(model_path: str, weights_dtype: str, cores: list[int], ready, stop) -> None:
    os.sched_setaffinity(0, cores)
    b = _Bench(model_path, len(cores), weights_dtype, budget=256, kv_tokens=4096)
    ready.set()
    while not stop.is_set():
        b.add(512, prefill_only=True)
        while b.engine.has_work() and not stop.is_set():
            b.engine.step()
        b.clear()


def measure_corun(model_path: str, weights_dtype: str, steps: int = 8) -> float:
    """Decode step time with a prefill computing on the other cores over the time alone, on one
    core each; 1.0 on a one-core machine."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return 1.0
    mine, theirs = cores[-1:], cores[:-1]
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, mine)
    try:
        b = _Bench(model_path, 1, weights_dtype, budget=2048, kv_tokens=8192)

        def decode_times() -> list[float]:
            for _ in range(4):
                b.add(256, max_tokens=steps + 2)
            b.engine.step()
            out = [b.timed_step() for _ in range(steps)]
            b.clear()
            return out

        decode_times()  # warm-up
        alone = statistics.median(decode_times())
        ctx = mp.get_context("spawn")
        ready, stop = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_prefill_loop, args=(model_path, weights_dtype, theirs, ready, stop), daemon=True)
        proc.start()
        try:
            if not ready.wait(300):
                raise RuntimeError("the co-running prefill process did not start")
            time.sleep(1.0)
            together = statistics.median(decode_times())
        finally:
            stop.set()
            proc.join(60)
            if proc.is_alive():
                proc.kill()
        b.engine.close()
    finally:
        os.sched_setaffinity(0, saved)
    log.info("decode step alone %.1f ms, with a prefill on the other cores %.1f ms", alone * 1e3, together * 1e3)
    return together / alone


def profile_engine(
    model_path: str,
    threads: list[int],
    weights_dtype: str = "auto",
    grid: Grid = Grid(),
    corun: bool = True,
    handoff_s: float = DEFAULT_HANDOFF_S,
) -> EngineProfile:
    page_size = EngineConfig(model_path=model_path).page_size
    # the format measured, by name (auto: what serve's default resolves to on this machine)
    weights_dtype = EngineConfig(model_path=model_path, weights_dtype=weights_dtype or "auto").weights_format
    saved = torch.get_num_threads()
    try:
        per = {t: measure_threads(model_path, t, weights_dtype, grid) for t in threads}
    finally:
        torch.set_num_threads(saved)
    return EngineProfile(
        model=os.path.basename(os.path.normpath(model_path)),
        weights_dtype=weights_dtype,
        page_size=page_size,
        threads=per,
        corun_slowdown=measure_corun(model_path, weights_dtype) if corun else 1.0,
        handoff_s=handoff_s,
        source=f"measured by the profiler (backend/planner/profiler.py) on {kernel_path_line(weights_dtype)}",
    )
