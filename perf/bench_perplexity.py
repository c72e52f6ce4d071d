"""Benchmark: perplexity through the server per weights format, and against llama.cpp.

Per mode (``aggregated``; ``disagg``: 1 prefill + 1 decode instance, cores split, every prefill
over the KV fabric) and per weights format (``weights_dtype`` float32 / bfloat16 / int4w, the KV
cache as the engine's default), one real ``tritonserver`` with the OpenAI frontend in front:

- perplexity on ``perf/data/heldout_en.txt`` (held-out prose written for this repository, CC0)
  through ``/v1/completions`` with the prompt as token ids (the SmolLM2 tokenizer), ``echo``,
  ``logprobs=1`` and ``max_tokens=0``: the text cut into windows of ``--window`` tokens
  (default 512, non-overlapping; each window is prefilled in chunks of the engine's
  ``max_num_batched_tokens``, 256 by default), every token of a window scored but its first
  (it has no context); perplexity = exp(mean negative log-likelihood over the scored tokens);
- next-token argmax agreement with float32 in the same mode: at each scored position, whether
  the top-1 token (``top_logprobs`` with ``logprobs=1``) equals float32's; and how often the
  top-1 token is the text's next token;
- one-stream decode tokens/s after the first token (Triton's gRPC streaming API, ``--tokens``
  greedy tokens, end of sequence ignored, the median of ``--streams`` streams), with the
  1-minute load average beside it (the rate is sensitive to other work on the cores).

Then llama.cpp's server (``llama-cpp-python[server]``, built on first use into
``.venv/tools/llama-cpp``, started by ``perf/lib/servers.py``) on the Q4_1 GGUF our checkpoint is
prepared from, with ``logits_all`` (needed for ``echo`` + ``logprobs``): its completions API
takes text only, so each window goes as its decoded text (the run checks that llama.cpp cuts it
into the same number of tokens, and reports how many token strings equal ours), after the BOS
text ``<|im_start|>``: llama-cpp-python pairs each echoed prompt token with the distribution
that follows it unless the prompt starts with BOS (abetlen/llama-cpp-python#1983), and the GGUF
adds none. Our float32 (first mode) is scored once more with the same BOS first: llama.cpp's
perplexity and top-1 agreement are against that. Also its one-stream tokens/s.
Prints a markdown table; writes JSON to the results folder (``perf/results/``).

    python -m perf.bench_perplexity [--formats float32,bfloat16,int4w] [--modes aggregated,disagg]
                                    [--window 512] [--tokens 128] [--streams 3] [--no-llama-cpp]
                                    [--engine-threads N]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import requests

from backend.planner import stats
from perf.lib import loadgen
from perf.lib.machine import cpu_id, cpu_model
from perf.lib.progress import bar
from perf.lib.results import results_dir

DECODE_PROMPT = "Write a long story about a lighthouse keeper and the sea."


def windows(ids: list[int], size: int) -> list[list[int]]:
    """Non-overlapping windows of ``size`` tokens (the last one shorter); a window of one token
    scores nothing and is dropped."""
    return [w for w in (ids[i : i + size] for i in range(0, len(ids), size)) if len(w) >= 2]


def _scored(lp: dict, first: int, n: int, where: str) -> dict:
    """Entries ``first``..``n - 1`` of an echoed prompt's legacy ``logprobs``: the log-probability
    of each of those prompt tokens and the top-1 token at its position."""
    tokens, token_lps, tops = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
    if len(token_lps) < n or token_lps[0] is not None or any(x is None for x in token_lps[first:n]):
        raise RuntimeError(f"{where}: echo gave {len(token_lps)} log-probs for a {n}-token prompt: {token_lps[:3]}")
    top1 = [max(t, key=t.get) if t else None for t in tops[first:n]]
    return {"logprobs": [float(x) for x in token_lps[first:n]], "tokens": tokens[first:n], "top1": top1}


def _complete(url: str, body: dict, timeout_s: float = 600) -> dict:
    r = requests.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()["choices"][0]["logprobs"]


def score_window(url: str, model: str, window: list[int], max_tokens: int = 0, prefix: tuple[int, ...] = ()) -> dict:
    """Log-probabilities of tokens 2..n of ``window`` (token ids, after the ids of ``prefix``)
    and the top-1 token at each of those positions, from an OpenAI completions API with ``echo``."""
    prompt = [*prefix, *window]
    body = {"model": model, "prompt": [prompt], "max_tokens": max_tokens, "echo": True, "logprobs": 1, "temperature": 0}
    return _scored(_complete(url, body), len(prefix) + 1, len(prompt), url)


def score_text(url: str, model: str, text: str, n: int) -> dict:
    """The same from a server that takes text only: ``text`` (its own tokenizer must cut it into
    ``n`` tokens after a leading BOS) scored with ``max_tokens`` 1, the generated token left out."""
    body = {"model": model, "prompt": text, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    lp = _complete(url, body)
    if len(lp["tokens"]) != n + 1:
        raise RuntimeError(f"{url}: the text became {len(lp['tokens']) - 1} tokens, not {n}")
    return _scored(lp, 1, n, url)


def perplexity(score, wins: list[list[int]], desc: str = "windows") -> dict:
    """Perplexity over the windows, ``score(window)`` giving each window's scored tokens
    (``desc``: the progress line's label)."""
    t0 = time.monotonic()
    scored = [score(w) for w in bar(wins, desc)]
    lps = [x for s in scored for x in s["logprobs"]]
    nll = -sum(lps) / len(lps)
    hits = [t == top for s in scored for t, top in zip(s["tokens"], s["top1"])]
    return {
        "ppl": math.exp(nll),
        "nll_per_token": nll,
        "scored_tokens": len(lps),
        "windows": len(wins),
        "top1_is_next_token": sum(hits) / len(hits),
        "top1": [top for s in scored for top in s["top1"]],
        "tokens": [t for s in scored for t in s["tokens"]],
        "score_s": round(time.monotonic() - t0, 1),
    }


def agreement(a: list, b: list) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return sum(x == y for x, y in zip(a, b)) / len(a)


def decode_figures(streams: list[list[float]]) -> dict:
    """One-stream tokens/s after the first token over ``streams`` (each one's token arrival times),
    with the 1-minute load average."""
    rates = [stats.decode_rate(times) for times in streams]
    return {
        "tok_s_median": stats.median(rates),
        "tok_s_best": max(rates),
        "streams": len(streams),
        "loadavg_1m": os.getloadavg()[0],  # other work on the machine: these rates are sensitive to it
    }


def decode_rate(grpc_url: str, tokens: int, streams: int) -> dict:
    from backend.client import stream_generate

    stream_generate(grpc_url, "warm up", 8, ignore_eos=True)
    runs = []
    for i in range(streams):
        res = stream_generate(grpc_url, f"{i} {DECODE_PROMPT}", tokens, ignore_eos=True, temperature=0.0)
        if res.error is not None or len(res.times) < 2:
            raise RuntimeError(f"stream {i}: {res.error}")
        runs.append(list(res.times))
    return decode_figures(runs)


def run_ours(mode: str, fmt: str, wins: list[list[int]], args, bos_id: int | None = None) -> dict:
    """One deployment: perplexity over the windows, one-stream decode rate; with ``bos_id`` also
    the windows scored after that token (``bos``: the context llama.cpp's figures have)."""
    from perf.lib import servers

    log_dir = results_dir() / f"perplexity-{mode}-{fmt}"
    overrides = {"weights_dtype": fmt, "max_tokens_limit": str(max(256, args.tokens))}
    if mode == "disagg":
        overrides["local_prefill_max_tokens"] = "0"  # every window's prefill crosses the KV fabric
    per_model = (
        {"llm": {"num_threads": str(args.engine_threads)}} if args.engine_threads and mode == "aggregated" else {}
    )
    with servers.started_with_openai(mode, log_dir, overrides=overrides, per_model=per_model) as (server, frontend):
        url, model = frontend.url, frontend.served_model_name
        score_window(url, model, wins[0][:16], args.max_tokens)  # warm up
        res = perplexity(lambda w: score_window(url, model, w, args.max_tokens), wins, f"{mode} {fmt}")
        if bos_id is not None:
            bos = (bos_id,)
            res["bos"] = perplexity(
                lambda w: score_window(url, model, w, args.max_tokens, bos), wins, f"{mode} {fmt}, after BOS"
            )
        res["decode"] = decode_rate(server.grpc_url, args.tokens, args.streams)
        return res


def run_llama_cpp(wins: list[list[int]], texts: list[str], args) -> dict:
    """llama.cpp's server on the packaged GGUF with ``logits_all``: perplexity over the windows
    sent as text (``texts``: each window decoded, after the BOS text), and one-stream tokens/s
    (perf/bench_cpp_baseline.py's measurement)."""
    from build_scripts.prepare_model import find_packaged_gguf
    from perf.lib.servers import start_llama_cpp

    gguf = find_packaged_gguf()
    with start_llama_cpp(
        gguf,
        args.cpp_threads,
        results_dir() / "perplexity-llama-cpp" / "server.log",
        n_ctx=max(2048, args.window + 16),
        extra=("--logits_all", "true", "--model_alias", "baseline"),
    ) as server:
        url = server.url
        score_text(url, "baseline", texts[0], len(wins[0]))  # warm up
        by_text = dict(zip(map(tuple, wins), texts))
        res = perplexity(lambda w: score_text(url, "baseline", by_text[tuple(w)], len(w)), wins, "llama.cpp")
        res["decode"] = decode_figures(server.timed_streams(DECODE_PROMPT, args.tokens, args.streams))
    res["threads"] = args.cpp_threads
    res["gguf"] = gguf.name
    return res


def table(rows: list[dict], cpu: str) -> str:
    out = [
        f"CPU: {cpu} ({len(os.sched_getaffinity(0))} cores available to the run)",
        "",
        "| server | mode | weights | context | perplexity | NLL/token | scored tokens | top-1 = reference top-1 "
        "| top-1 = next token | decode tok/s (1 stream, median; load avg) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['server']} | {r['mode']} | {r['weights']} | {r['context']} "
        if r.get("error"):
            out.append(head + f"| failed: {r['error'][:160]} ||||||")
            continue
        agree = f"{100 * r['agree']:.2f} % ({r['reference']})" if r.get("agree") is not None else "-"
        d = r.get("decode")
        rate = f"{d['tok_s_median']:.1f} ({d['loadavg_1m']:.1f})" if d else "(as above)"
        out.append(
            head + f"| {r['ppl']:.3f} | {r['nll_per_token']:.4f} | {r['scored_tokens']} | {agree} "
            f"| {100 * r['top1_is_next_token']:.2f} % | {rate} |"
        )
    return "\n".join(out)


def _compare(row: dict, ref: dict | None, name: str) -> None:
    if ref is not None and "top1" in row and "top1" in ref:
        row["agree"], row["reference"] = agreement(row["top1"], ref["top1"]), name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="float32,bfloat16,int4w")
    p.add_argument("--modes", default="aggregated,disagg")
    p.add_argument("--text", default=str(loadgen.HELDOUT))
    p.add_argument("--window", type=int, default=512, help="tokens per window (non-overlapping)")
    p.add_argument("--max-tokens", type=int, default=0, help="max_tokens of the scoring requests (0 or 1)")
    p.add_argument("--tokens", type=int, default=128, help="decode tokens per stream")
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument(
        "--engine-threads",
        type=int,
        default=0,
        help="aggregated mode: the engine's threads (num_threads; 1 = perf.bench_cpp_baseline's setting); 0: all cores",
    )
    p.add_argument("--cpp-threads", type=int, default=len(os.sched_getaffinity(0)))
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = loadgen.load_tokenizer()
    ids = tok(Path(args.text).read_text())["input_ids"]
    wins = windows(ids, args.window)
    cpu = f"{cpu_model()} ({cpu_id()})"
    print(f"{args.text}: {len(ids)} tokens, {len(wins)} windows of <= {args.window}; CPU {cpu}", flush=True)
    modes, formats = args.modes.split(","), args.formats.split(",")
    # llama-cpp-python's echoed log-probabilities are one position off unless the prompt starts
    # with the BOS token (it scores each token with the distribution that follows it,
    # abetlen/llama-cpp-python#1983); the GGUF adds none, so its windows start with the BOS text
    # and our float32 is scored once more the same way for the comparison
    bos_ref_at = (modes[0], "float32") if not args.no_llama_cpp and "float32" in formats else None
    rows: list[dict] = []
    bos_ref = None

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("top1", "tokens")}), flush=True)

    for mode in modes:
        ref = None
        for fmt in formats:
            row: dict = {"server": "triton-disagg", "mode": mode, "weights": fmt, "context": "window"}
            try:
                row.update(run_ours(mode, fmt, wins, args, tok.bos_token_id if (mode, fmt) == bos_ref_at else None))
            except Exception as e:  # a format that fails is reported, the others still run
                row["error"] = f"{type(e).__name__}: {e}"
            if fmt == "float32" and "top1" in row:
                ref = row
            _compare(row, ref, f"float32 {mode}")
            bos = row.pop("bos", None)
            emit(row)
            if bos is not None:
                bos_ref = {**bos, "server": "triton-disagg", "mode": mode, "weights": fmt}
                bos_ref["context"] = f"{tok.bos_token} + window"
                emit(bos_ref)
    if not args.no_llama_cpp:
        row = {"server": "llama.cpp (llama-cpp-python 0.3.36)", "mode": "-", "weights": "GGUF Q4_1"}
        row["context"] = f"{tok.bos_token} + window (as text)"
        texts = [tok.bos_token + tok.decode(w) for w in wins]
        try:
            row.update(run_llama_cpp(wins, texts, args))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
        _compare(row, bos_ref, "float32, same context")
        if bos_ref is not None and "tokens" in row:
            row["tokens_equal_ours"] = agreement(row["tokens"], bos_ref["tokens"])
        emit(row)
    md = table(rows, cpu)
    print(md)
    out = results_dir() / f"perplexity-{time.strftime('%Y%m%d-%H%M%S')}.json"
    summary = {
        "cpu": cpu,
        "machine": platform.machine(),
        "cores": len(os.sched_getaffinity(0)),
        "text": str(args.text),
        "text_tokens": len(ids),
        "window": args.window,
        "args": vars(args),
        "rows": [{k: v for k, v in r.items() if k not in ("top1", "tokens")} for r in rows],
        "table": md,
    }
    out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
