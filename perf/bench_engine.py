"""Benchmark: our paged engine vs transformers on the same checkpoint, in one process.

Measures prefill tokens/s of a 512-token prompt (engine vs transformers' forward), decode tokens/s
at batch 1 (engine vs ``generate`` with its own KV cache) and the engine's aggregate decode tokens/s
at batch 16 with a 256-token context (vs transformers' batch-1 decode; transformers' batch-16
``generate`` is shown for reference). The machine is shared, so prefill is the best of ``--repeats``
runs and decode rates come from the median step time; ours and transformers' runs are interleaved.
Then, per weights format (``--profile-formats``), where the engine's step goes: a decode step at
batch 1 and a 256-token prefill step, profiled (``perf/lib/step_profile.py``: ms per step by op
class, op calls per step, and the time outside ops: Python and dispatch).
Prints markdown tables; writes JSON to the results folder (``perf/results/``).

    python -m perf.bench_engine [--model DIR] [--threads 2] [--repeats 3]
                                [--profile-formats float32,fp16w,int4w] [--profile-steps 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import platform
import time
from typing import TYPE_CHECKING

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from backend.engine.sampling_params import SamplingParams  # noqa: E402
from backend.planner.stats import gaps, median  # noqa: E402
from perf.lib.progress import bar  # noqa: E402
from perf.lib.results import results_dir  # noqa: E402
from perf.lib.step_profile import markdown, profile_steps  # noqa: E402

if TYPE_CHECKING:
    from backend.engine.config import EngineConfig
    from backend.engine.llm_engine import LLMEngine

TARGETS = {"prefill": 0.8, "decode_b1": 1.0, "decode_b16": 4.0}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(10, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_prefill(engine: LLMEngine, prompt: list[int]) -> None:
    engine.add_request("prefill", prompt, prefill_only=True)
    while engine.has_work():
        engine.step()
    engine.release("prefill")


def engine_decode_step_times(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> list[float]:
    """Durations of the engine's decode steps (every request past its prefill)."""
    params = SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{i}", prompt, params)
    engine.step()  # all prefills fit in one step's budget
    times = []
    while engine.has_work():
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        assert len(outputs) == len(prompts), "benchmark expects every request to decode each step"
    return times


class StepClock:
    """A logits processor that timestamps every generate step (called once per new token)."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores

    def step_times(self) -> list[float]:
        return gaps(self.stamps)


def hf_decode_step_times(model, prompts: list[list[int]], new_tokens: int) -> list[float]:
    from transformers import LogitsProcessorList

    ids = torch.tensor(prompts)
    clock = StepClock()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens + 1,
        min_new_tokens=new_tokens + 1,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([clock]),
    )
    return clock.step_times()


def compare_decode(engine, hf, prompts: list[list[int]], new_tokens: int, repeats: int, hf_repeats: int, desc: str):
    """Decode tokens/s from the median step time (robust to stalls on a shared machine), ours and
    transformers' runs interleaved. Returns (ours, transformers) tokens/s for the whole batch."""
    ours, theirs = [], []
    for r in bar(range(repeats), desc):
        ours += engine_decode_step_times(engine, prompts, new_tokens)
        if r < hf_repeats:
            theirs += hf_decode_step_times(hf, prompts, new_tokens)
    return len(prompts) / median(ours), len(prompts) / median(theirs)


def step_profiles(config: EngineConfig, formats: list[str], steps: int) -> dict[str, dict]:
    """Per format (``config`` with that ``weights_dtype``): a decode step at batch 1 (context 32)
    and a 256-token prefill step, profiled."""
    from backend.engine.llm_engine import LLMEngine

    rows = {}
    for fmt in bar(formats, "step profiles"):
        engine = LLMEngine(dataclasses.replace(config, weights_dtype=fmt, num_pages=None))
        vocab = engine.runner.vocab_size
        with torch.inference_mode():
            engine_prefill(engine, random_prompt(64, vocab, 7))  # warm-up
            engine.add_request(
                "p", random_prompt(32, vocab, 8), SamplingParams(max_tokens=2 * steps + 2, ignore_eos=True)
            )
            engine.step()  # its prefill
            rows[f"{fmt}, decode b1"] = profile_steps(engine.step, steps)
            while engine.has_work():
                engine.step()
            engine.release("p")
            prefill = functools.partial(engine_prefill, engine, random_prompt(256, vocab, 9))
            rows[f"{fmt}, prefill 256"] = profile_steps(prefill, max(2, steps // 4))
        engine.close()
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the prepared SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--profile-formats", default="float32,fp16w,int4w", help="weights formats to profile ('' none)")
    parser.add_argument("--profile-steps", type=int, default=16, help="decode steps per profile (prefill: a quarter)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    if args.model is None:
        from build_scripts.prepare_model import ensure_model

        args.model = str(ensure_model())

    from transformers import AutoModelForCausalLM

    from backend.engine.config import EngineConfig
    from backend.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model_path=args.model,
        num_threads=args.threads,
        kv_cache_tokens=16 * 320,
        max_num_batched_tokens=4096,
        max_num_seqs=16,
        enable_prefix_caching=False,  # each run repeats its prompt: every prefill computes all of it
    )
    engine = LLMEngine(config)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    load_before = os.getloadavg()
    results = {}
    with torch.inference_mode():
        prompt512 = random_prompt(512, vocab, 0)
        ids = torch.tensor([prompt512])
        hf(ids[:, :64], logits_to_keep=1)  # warm-up: one-time kernel and allocator set-up on both sides
        engine_prefill(engine, prompt512[:64])
        ours, theirs = [], []
        for _ in bar(range(args.repeats), "prefill"):
            theirs.append(timed(lambda: hf(ids, logits_to_keep=1)))
            ours.append(timed(lambda: engine_prefill(engine, prompt512)))
        results["prefill"] = {
            "ours_tok_s": 512 / min(ours),
            "hf_tok_s": 512 / min(theirs),
            "baseline": "transformers forward, 512 tokens, logits of the last position",
        }

        n = args.decode_tokens
        ours_b1, hf_b1 = compare_decode(
            engine, hf, [random_prompt(32, vocab, 1)], n, args.repeats, args.repeats, "decode b1"
        )
        results["decode_b1"] = {
            "ours_tok_s": ours_b1,
            "hf_tok_s": hf_b1,
            "baseline": f"transformers generate, batch 1, context 32, {n} tokens",
        }

        b16 = [random_prompt(256, vocab, 2 + i) for i in range(16)]
        ours_b16, hf_b16 = compare_decode(engine, hf, b16, n, args.repeats, 1, "decode b16")
        results["decode_b16"] = {
            "ours_tok_s": ours_b16,
            "hf_tok_s": hf_b1,
            "hf_batch16_tok_s": hf_b16,
            "baseline": "transformers generate, batch 1 (target: 4x); "
            "hf_batch16_tok_s: generate at batch 16, context 256",
        }
    for name, row in results.items():
        row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
        row["target"] = TARGETS[name]
        row["met"] = row["ratio"] >= TARGETS[name]
    engine.close()
    formats = [f for f in args.profile_formats.split(",") if f]
    profiles = step_profiles(config, formats, args.profile_steps) if formats else {}
    report = {
        "results": results,
        "step_profile": profiles,
        "threads": args.threads,
        "repeats": args.repeats,
        "model": args.model,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print_table(report)
    path = results_dir() / f"bench_engine_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {path}")
    return report


def print_table(report: dict) -> None:
    print(
        f"\nthreads={report['threads']}, {report['repeats']} runs (prefill: best run; decode: median step); "
        f"load average before/after {report['loadavg_before'][0]:.1f}/{report['loadavg_after'][0]:.1f} "
        f"on {report['cpus']} CPUs\n"
    )
    print("| measure | ours tok/s | transformers tok/s | ratio | target | met |")
    print("|---|---:|---:|---:|---:|---|")
    for name, row in report["results"].items():
        print(
            f"| {name} | {row['ours_tok_s']:.1f} | {row['hf_tok_s']:.1f} | {row['ratio']:.2f}x | "
            f">= {row['target']}x | {'yes' if row['met'] else 'NO'} |"
        )
    b16 = report["results"]["decode_b16"]
    print(f"\n(transformers generate at batch 16, context 256: {b16['hf_batch16_tok_s']:.1f} tok/s)")
    if report["step_profile"]:
        from backend.engine.formats import kernel_path_line

        print(
            f"\nWhere the engine's step goes, {report['threads']} threads; {kernel_path_line()} "
            "(ms per step by op class, each op's own time; outside ops: the step's unprofiled wall time "
            "minus the ops' own time)\n"
        )
        print(markdown(report["step_profile"]))


if __name__ == "__main__":
    main()
