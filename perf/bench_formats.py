"""Benchmark: the engine's weight formats (``weights_dtype`` float32 / bfloat16 / fp16w / int4w:
``--formats`` takes any of ``WEIGHT_FORMATS``; the KV cache float32 for all) side by side in one
run, on the real model.

In one process, per format: prefill tokens/s (a 512-token prompt, best of 3), decode tokens/s
at batch 1 and batch 16 (from the median step time), and quality against float32: the share
of greedy tokens identical to float32's over the first 64 tokens of 8 prompts (each run alone),
the mean |logit difference| at one prompt's last position, and on held-out English
(``perf/data/heldout_en.txt``; ``--heldout``) perplexity against the reference's and next-token
argmax agreement with it, teacher forced through the engine's runner: windows of 512 prompt
tokens (non-overlapping), each prefilled in chunks of 256 (``max_num_batched_tokens``' default),
logits at every position, then 32 more tokens fed one decode step at a time (the decode path);
reported for the prompt positions and the decode steps apart. Then, with ``--server``, one
stream of 128 tokens through a real ``tritonserver`` (aggregated) per format and engine thread
count (``--server-threads``; one thread leaves a core to Triton and the client): tokens/s after
the first token. Each format runs with each ``--decoders`` setting (``EngineConfig.decoder``:
``transformers``, transformers' modules; ``auto``, the lean layer loop); quality is measured
against the first variant (float32 through transformers' modules by default). Prints a markdown
table; writes ``formats.{json,md}`` to the results folder (``perf/results/``).

    python -m perf.bench_formats [--formats float32,bfloat16,fp16w,int4w] [--decoders transformers,auto]
                                 [--threads 2] [--server] [--heldout FILE] [--windows N]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from backend.engine.heldout import WINDOW, heldout_figures, heldout_windows  # noqa: E402
from backend.engine.sampling_params import SamplingParams  # noqa: E402
from backend.planner.stats import median  # noqa: E402
from perf.lib.loadgen import HELDOUT  # noqa: E402
from perf.lib.progress import bar  # noqa: E402
from perf.lib.results import results_dir  # noqa: E402

if TYPE_CHECKING:
    from backend.engine.llm_engine import LLMEngine

PREFILL_CHUNK = 256
PROMPTS = [
    "The history of the printing press begins",
    "Write a short poem about the sea.",
    "Explain how a refrigerator works.",
    "def quicksort(items):",
    "List five countries in Africa and their capitals.",
    "Once upon a time, a robot",
    "What is the difference between weather and climate?",
    "Summarize the rules of chess in three sentences.",
]


def _engine(model_dir: str, fmt: str, decoder: str, threads: int) -> LLMEngine:
    from backend.engine.config import EngineConfig
    from backend.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model_path=model_dir,
        weights_dtype=fmt,
        decoder=decoder,
        kv_dtype="float32",
        num_threads=threads,
        kv_cache_tokens=16384,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,  # every prefill and greedy run computes its whole prompt
    )
    return LLMEngine(config)


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    return tokens


def _greedy(engine: LLMEngine, ids: list[int], n: int) -> list[int]:
    engine.add_request("q", ids, SamplingParams(max_tokens=n, ignore_eos=True))
    return _drain(engine)["q"]


def _decode_rate(engine: LLMEngine, batch: int, ids: list[int], steps: int = 24) -> float:
    """Decode tokens/s at ``batch`` sequences: batch / median step time once all are decoding."""
    for i in range(batch):
        engine.add_request(f"d{i}", ids, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    times = []
    while engine.has_work():
        decoding = all(s.num_uncomputed <= 1 for s in engine.scheduler.running) and not engine.scheduler.waiting
        t0 = time.perf_counter()
        engine.step()
        if decoding and len(engine.scheduler.running) == batch:
            times.append(time.perf_counter() - t0)
    return batch / median(times[2:] or times)


def _prefill_rate(engine: LLMEngine, ids: list[int]) -> float:
    best = float("inf")
    for r in range(3):
        engine.add_request(f"p{r}", ids, SamplingParams(max_tokens=1), prefill_only=True)
        t0 = time.perf_counter()
        _drain(engine)
        best = min(best, time.perf_counter() - t0)
        engine.release(f"p{r}")
    return len(ids) / best


def _last_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    engine.add_request("l", ids, SamplingParams(max_tokens=1), prefill_only=True)
    out = None
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                out = o
    engine.release("l")
    return out.logits.float()


def _teacher_forced(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``ids`` but the last: its first WINDOW tokens prefilled in
    chunks of PREFILL_CHUNK (logits of every position), the rest one decode step each. Runs the
    engine's runner directly, on pages of the idle engine's pool (prefix caching off)."""
    from backend.engine.protocol import BatchEntry

    runner = engine.runner
    pages = list(range(-(-len(ids) // runner.pool.page_size)))
    out = []
    with torch.inference_mode():
        for s in range(0, WINDOW, PREFILL_CHUNK):
            chunk = ids[s : s + PREFILL_CHUNK]
            position_logits = runner.run([BatchEntry(chunk, s, pages)], num_logits=[len(chunk)]).position_logits
            assert position_logits is not None
            out.append(position_logits[0])
        out += [runner.run([BatchEntry([ids[p]], p, pages)]).logits for p in range(WINDOW, len(ids) - 1)]
    return torch.cat(out).float()


def _heldout(engine: LLMEngine, windows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per scored position of every window: the negative log-likelihood of the text's next token
    and the argmax token."""
    nll, top = [], []
    for ids in windows:
        assert not engine.has_work()
        logits = _teacher_forced(engine, ids)
        target = torch.tensor(ids[1:])
        nll.append(-F.log_softmax(logits, -1).gather(1, target[:, None])[:, 0])
        top.append(logits.argmax(-1))
    return torch.stack(nll), torch.stack(top)


def _label(fmt: str, decoder: str) -> str:
    return f"{fmt}, {'lean loop' if decoder == 'auto' else decoder}"


def engine_figures(
    model_dir: str,
    variants: list[tuple[str, str]],
    threads: int,
    tokenizer,
    windows: list[list[int]] | None = None,
    greedy_tokens: int = 64,
) -> dict:
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    long_prompt = (tokenizer.encode(" ".join(PROMPTS), add_special_tokens=False) * 20)[:512]
    context = long_prompt[:256]
    results, reference, heldout_reference = {}, None, None
    for fmt, decoder in bar(variants, "formats"):
        engine = _engine(model_dir, fmt, decoder, threads)
        greedy = [_greedy(engine, ids, greedy_tokens) for ids in prompts]
        logits = _last_logits(engine, prompts[0])
        r = {
            "prefill_tok_s": _prefill_rate(engine, long_prompt),
            "decode_b1_tok_s": _decode_rate(engine, 1, context),
            "decode_b16_tok_s": _decode_rate(engine, 16, context),
        }
        if reference is None:
            reference = (greedy, logits)
        same = sum(sum(a == b for a, b in zip(g, ref)) for g, ref in zip(greedy, reference[0]))
        r["identical_greedy_share"] = same / sum(len(g) for g in reference[0])
        r["mean_abs_logit_diff"] = float((logits - reference[1]).abs().mean())
        if windows:
            nll, top = _heldout(engine, windows)
            if heldout_reference is None:
                heldout_reference = (nll, top)
            r.update(heldout_figures(nll, top, heldout_reference))
        results[_label(fmt, decoder)] = r
        engine.close()
        print(_label(fmt, decoder), {k: round(v, 3) for k, v in r.items()}, flush=True)
    return results


def server_figures(
    variants: list[tuple[str, str]], threads: list[int], envs: dict[str, dict], tokens: int = 128
) -> dict:
    """Per variant, engine thread count and server environment (``envs``: name -> variables):
    the best of 2 streams' tokens/s after the first token."""
    from backend.client import stream_generate
    from perf.lib import servers

    out: dict = {}
    runs = [(fmt, decoder, env, n) for fmt, decoder in variants for env in envs.items() for n in threads]
    for fmt, decoder, (env_name, env), n in bar(runs, "server runs"):
        label = _label(fmt, decoder)
        with servers.started(
            "aggregated",
            overrides={"weights_dtype": fmt, "decoder": decoder},
            per_model={"llm": {"num_threads": str(n)}},
            log_dir=results_dir() / f"formats-{fmt}-{decoder}-{n}",
            extra_env=env,
        ) as server:
            stream_generate(server.grpc_url, "warm up", 8, ignore_eos=True)
            rates = []
            for _ in range(2):
                res = stream_generate(server.grpc_url, PROMPTS[2], tokens, ignore_eos=True, temperature=0.0)
                assert res.error is None, res.error
                rates.append((len(res.token_ids) - 1) / (res.times[-1] - res.times[0]))
            out.setdefault(label, {})[f"server_stream_tok_s_{n}_threads{env_name}"] = max(rates)
        print(label, n, env_name, out[label], flush=True)
    return out


def _heldout_cells(r: dict) -> str:
    if "heldout_ppl_ratio_prefill" not in r:
        return "- | -"
    return (
        f"{r['heldout_ppl_ratio_prefill']:.3f} / {r['heldout_ppl_ratio_decode']:.3f} "
        f"| {100 * r['heldout_argmax_agree_prefill']:.1f}% / {100 * r['heldout_argmax_agree_decode']:.1f}%"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="float32,bfloat16,fp16w,int4w")
    p.add_argument("--decoders", default="transformers,auto", help="EngineConfig.decoder settings to compare")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--model", default=None)
    p.add_argument("--heldout", default=str(HELDOUT), help="held-out text for perplexity ('' to skip)")
    p.add_argument("--windows", type=int, default=7, help="held-out windows of 512 (+32 decode) tokens")
    p.add_argument(
        "--greedy-tokens",
        type=int,
        default=64,
        help="greedy tokens per prompt (of 8), compared with the first format's",
    )
    p.add_argument("--server", action="store_true", help="also one stream through a real server per format")
    p.add_argument("--server-threads", default="2,1", help="engine threads (num_threads) of the server runs")
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="also run each server with this variable set (e.g. OMP_WAIT_POLICY=PASSIVE)",
    )
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from build_scripts.prepare_model import ensure_model

    model_dir = str(ensure_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    variants = [(fmt, dec) for fmt in args.formats.split(",") for dec in args.decoders.split(",")]
    windows = heldout_windows(tokenizer, Path(args.heldout), args.windows) if args.heldout else None
    results = engine_figures(model_dir, variants, args.threads, tokenizer, windows, args.greedy_tokens)
    if args.server:
        threads = [int(t) for t in args.server_threads.split(",")]
        envs = {"": {}}
        for item in args.server_env:
            key, _, value = item.partition("=")
            envs[f", {item}"] = {key: value}
        for label, r in server_figures(variants, threads, envs).items():
            results[label].update(r)
    rows = [
        "| weights, decoder | prefill tok/s (512) | decode tok/s b1 | decode tok/s b16 | identical greedy tokens "
        "| mean abs logit diff | held-out ppl ratio, prompt / decode | held-out argmax agreement, prompt / decode "
        "| server stream tok/s (by engine threads) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fmt, r in results.items():
        runs = {k.removeprefix("server_stream_tok_s_"): v for k, v in r.items() if k.startswith("server_stream_tok_s_")}
        server = ", ".join(f"{v:.1f} ({n.replace('_threads', ' thr')})" for n, v in runs.items()) or "-"
        rows.append(
            f"| {fmt} | {r['prefill_tok_s']:.0f} | {r['decode_b1_tok_s']:.1f} | {r['decode_b16_tok_s']:.1f} "
            f"| {100 * r['identical_greedy_share']:.1f}% | {r['mean_abs_logit_diff']:.3f} | {_heldout_cells(r)} "
            f"| {server} |"
        )
    md = f"settings {vars(args)}\n\n" + "\n".join(rows) + "\n"
    out = results_dir()
    (out / "formats.json").write_text(json.dumps({"settings": vars(args), "results": results}, indent=2))
    (out / "formats.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
