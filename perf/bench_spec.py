"""Benchmark: speculative decoding (prompt lookup) vs plain decoding, in one process with the engine.

Two workloads, greedy, one stream at a time (decode tokens/s per stream):
- ``lookup_friendly``: "rewrite this code with one change" / "extract fields from this text":
  the output copies long runs from the prompt, so lookup drafts get accepted;
- ``no_lookup``: open-ended prompts whose output rarely repeats the context.
- ``rejected_drafts``: the open-ended prompts with a drafter whose drafts are always rejected,
  the worst case (a verify step costs more than a plain step; the engine backs off drafting).
Each prompt runs with speculation off and on (``--k`` drafts, ``--method`` drafter), interleaved,
``--repeats`` times; the median decode time counts. Reports accepted draft tokens per step,
tokens per step, decode tokens/s with and without, and their ratio (targets: >= 1.5x on the
lookup-friendly workload, >= 0.95x on the other); checks the outputs are identical.
``--decoders transformers,auto`` measures the same with each engine decoder (transformers'
modules, the lean layer loop), one engine after the other in the same process: a verify step's
cost relative to a plain step depends on how much of a step is per-token work.
Prints a markdown table; writes JSON to the results folder (``perf/results/``).

    python -m perf.bench_spec [--model DIR] [--k 4] [--method lookup] [--max-tokens 64] [--repeats 2]
                              [--decoders auto]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import TYPE_CHECKING

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from backend.engine.sampling_params import SamplingParams  # noqa: E402
from backend.planner.stats import median  # noqa: E402
from perf.lib.progress import bar  # noqa: E402
from perf.lib.results import results_dir  # noqa: E402

if TYPE_CHECKING:
    from backend.engine.llm_engine import LLMEngine

TARGETS = {"lookup_friendly": 1.5, "no_lookup": 0.95, "rejected_drafts": 0.95}
CODE = """def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users


def adults(users):
    return [u for u in users if u["age"] >= 18]
"""
WORKLOADS = {
    "lookup_friendly": [
        "Rewrite this code with one change: rename the function load_users to read_users. "
        "Output only the code.\n\n" + CODE,
        "Extract the fields name, email, phone, city and order number from this text and list them "
        "one per line as 'field: value'.\n\nHello, my name is Margaret Hamilton and I am writing about "
        "order number 44-1873-XQ. You can reach me at margaret.hamilton@example.org or on 555-0142. "
        "I live in Cambridge and the parcel never arrived.",
    ],
    "no_lookup": ["Write a short poem about the sea at night.", "Give three tips for learning a new language."],
    # the worst case: the drafter is replaced by one whose drafts are always rejected
    "rejected_drafts": ["Write a short poem about the sea at night.", "Give three tips for learning a new language."],
}


class RejectedDrafter:
    """Proposes token 0 (never the model's choice): every verify step accepts nothing."""

    def propose(self, seq, k: int) -> list[int]:
        return [0] * k


def decode_run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> dict:
    """Run one request alone; time and count its decode steps (after the first token)."""
    engine.add_request("bench", prompt, params)
    tokens, steps, t_first = [], 0, None
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        new = [t for o in outs for t in o.new_token_ids]
        if t_first is None:
            if new:
                t_first, n_first = now, len(new)
                tokens += new
            continue
        steps += 1
        tokens += new
    return {
        "tokens": tokens,
        "decode_tokens": len(tokens) - n_first,
        "steps": steps,
        "seconds": time.perf_counter() - t_first if steps else float("nan"),
    }


def bench(engine, tokenizer, k: int, method: str, max_tokens: int, repeats: int) -> dict:
    results = {}
    drafters = engine.decode_sampler.drafters
    for name, texts in WORKLOADS.items():
        real_drafter = drafters[method]
        if name == "rejected_drafts":
            drafters[method] = RejectedDrafter()
        rows = []
        for text in texts:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            runs = {"off": [], "on": []}
            for _ in bar(range(repeats), f"{name}: {text[:20]}"):
                for mode, n in (("off", 0), ("on", k)):
                    runs[mode].append(
                        decode_run(
                            engine,
                            prompt,
                            SamplingParams(max_tokens=max_tokens, num_draft_tokens=n, draft_method=method),
                        )
                    )
            off, on = runs["off"][0], runs["on"][0]
            t_off = median(r["seconds"] for r in runs["off"])
            t_on = median(r["seconds"] for r in runs["on"])
            rows.append(
                {
                    "prompt": text[:50],
                    "identical": off["tokens"] == on["tokens"],
                    "decode_tokens": on["decode_tokens"],
                    "steps_off": off["steps"],
                    "steps_on": on["steps"],
                    "tok_s_off": off["decode_tokens"] / t_off,
                    "tok_s_on": on["decode_tokens"] / t_on,
                }
            )
        drafters[method] = real_drafter
        decode_tokens = sum(r["decode_tokens"] for r in rows)
        steps_on = sum(r["steps_on"] for r in rows)
        tok_s_off = statistics.mean(r["tok_s_off"] for r in rows)
        tok_s_on = statistics.mean(r["tok_s_on"] for r in rows)
        results[name] = {
            "tokens_per_step": decode_tokens / steps_on,
            "accepted_per_step": decode_tokens / steps_on - 1,
            "tok_s_off": tok_s_off,
            "tok_s_on": tok_s_on,
            "speedup": tok_s_on / tok_s_off,
            "target": TARGETS[name],
            "identical": all(r["identical"] for r in rows),
            "prompts": rows,
        }
    return results


def main(argv=None) -> None:
    from transformers import AutoTokenizer

    from backend.engine.config import EngineConfig
    from backend.engine.llm_engine import LLMEngine
    from build_scripts.prepare_model import ensure_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--method", default="lookup", choices=["lookup", "hidden"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decoders", default="auto", help="EngineConfig.decoder settings to measure, comma-separated")
    args = ap.parse_args(argv)
    model = str(ensure_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    by_decoder = {}
    for decoder in args.decoders.split(","):
        engine = LLMEngine(
            EngineConfig(
                model_path=model, num_threads=args.threads, kv_cache_tokens=4096, max_model_len=2048, decoder=decoder
            )
        )
        by_decoder[decoder] = bench(engine, tokenizer, args.k, args.method, args.max_tokens, args.repeats)
        engine.close()
    print(
        f"\nSpeculative decoding ({args.method}, k={args.k}) vs plain greedy decoding, one stream, "
        f"{args.max_tokens} max tokens, {args.threads} threads\n"
    )
    print(
        "| decoder | workload | tokens/step (spec) | accepted drafts/step | tok/s plain | tok/s spec | speedup "
        "| target | identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for decoder, results in by_decoder.items():
        for name, r in results.items():
            print(
                f"| {decoder} | {name} | {r['tokens_per_step']:.2f} | {r['accepted_per_step']:.2f} | "
                f"{r['tok_s_off']:.1f} | {r['tok_s_on']:.1f} | {r['speedup']:.2f}x | >= {r['target']}x | "
                f"{r['identical']} |"
            )
    path = results_dir() / f"bench_spec_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(
        json.dumps(
            {
                "results": by_decoder[args.decoders.split(",")[-1]],  # the last decoder listed
                "by_decoder": by_decoder,
                "k": args.k,
                "method": args.method,
                "max_tokens": args.max_tokens,
                "threads": args.threads,
                "model": model,
            },
            indent=2,
        )
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
