"""Benchmark: one stream through our server against a quantized C++ CPU server on the same
machine, alternated in one run.

The baseline is llama.cpp's server through ``llama-cpp-python[server]`` (installed on first use
into ``.venv/tools/llama-cpp``; it compiles llama.cpp, minutes), serving the Q4_1 GGUF that our
checkpoint is prepared from. Ours is ``triton-disagg``'s aggregated deployment
(``--weights``, default int8, the lean layer loop, ``--engine-threads`` engine threads, default
1: the other core is left to Triton and the client). Each round starts one server, warms it
up, times ``--streams`` streams of ``--tokens`` tokens one after the other (greedy, end of
sequence ignored), stops it, then does the same with the other; which goes first alternates.
Reports tokens/s after the first token (best and median per round), ITL p50, and the ratio
ours/baseline per round and over the rounds' medians. Writes JSON to perf/results/.

    python -m perf.bench_cpp_baseline [--rounds 3] [--baseline-threads 2] [--engine-threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

from backend.launch.ports import free_port
from perf.tool_venv import ensure_tool

RESULTS = Path(__file__).resolve().parent / "results"
LLAMA_CPP = "llama-cpp-python[server]==0.3.36"
PROMPT = "Explain how a refrigerator works."


def _rates(times: list[float]) -> tuple[float, float]:
    """Tokens/s after the first token, and the median gap between tokens (ms)."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    return (len(times) - 1) / (times[-1] - times[0]), 1e3 * statistics.median(gaps)


def _summary(runs: list[tuple[float, float]]) -> dict:
    return {
        "tok_s_best": max(r for r, _ in runs),
        "tok_s_median": statistics.median(r for r, _ in runs),
        "itl_p50_ms": statistics.median(g for _, g in runs),
    }


def run_ours(weights: str, threads: int, streams: int, tokens: int) -> dict:
    from backend.client import stream_generate
    from perf import servers

    server = servers.start(
        "aggregated",
        overrides={"weights_dtype": weights},
        per_model={"llm": {"num_threads": str(threads)}},
        log_dir=RESULTS / f"cpp-baseline-ours-{weights}",
    )
    try:
        stream_generate(server.grpc_url, "warm up", 8, ignore_eos=True)
        runs = []
        for _ in range(streams):
            res = stream_generate(server.grpc_url, PROMPT, tokens, ignore_eos=True, temperature=0.0)
            if res.error is not None:
                raise RuntimeError(f"our server: {res.error}")
            runs.append(_rates(res.times))
        return _summary(runs)
    finally:
        server.stop()


def _llama_cpp_server(gguf: Path, threads: int, port: int, log_path: Path) -> subprocess.Popen:
    python = ensure_tool("llama-cpp", LLAMA_CPP, "python")
    cmd = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", str(threads)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048"]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama.cpp server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("llama.cpp server not ready")


def _stream_cpp(client, prompt: str, tokens: int) -> list[float]:
    """Arrival times of the streamed tokens (llama-cpp-python sends one token per chunk, then a
    final chunk with no text)."""
    times = []
    stream = client.completions.create(
        model="baseline",
        prompt=prompt,
        max_tokens=tokens,
        temperature=0.0,
        stream=True,
        extra_body={"logit_bias_type": "input_ids", "logit_bias": {"2": -100.0}},  # <|im_end|> (EOS) off
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    return times


def run_baseline(gguf: Path, threads: int, streams: int, tokens: int) -> dict:
    from openai import OpenAI

    port = free_port()
    proc = _llama_cpp_server(gguf, threads, port, RESULTS / "cpp-baseline-llama-cpp" / "server.log")
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        _stream_cpp(client, "warm up", 8)
        runs = []
        for _ in range(streams):
            times = _stream_cpp(client, PROMPT, tokens)
            if len(times) < tokens // 2:
                raise RuntimeError(f"llama.cpp streamed {len(times)} of {tokens} tokens")
            runs.append(_rates(times))
        return {**_summary(runs), "tokens_streamed": len(times)}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=3, help="streams per server per round")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--weights", default="int8", help="our weights_dtype")
    p.add_argument("--engine-threads", type=int, default=1, help="our engine's num_threads")
    p.add_argument("--baseline-threads", type=int, default=len(os.sched_getaffinity(0)))
    args = p.parse_args(argv)
    from build_scripts.prepare_model import find_packaged_gguf

    gguf = find_packaged_gguf()
    rounds = []
    for i in range(args.rounds):
        if i % 2 == 0:  # alternate which server goes first: the second run of a pair can be slower
            ours = run_ours(args.weights, args.engine_threads, args.streams, args.tokens)
            base = run_baseline(gguf, args.baseline_threads, args.streams, args.tokens)
        else:
            base = run_baseline(gguf, args.baseline_threads, args.streams, args.tokens)
            ours = run_ours(args.weights, args.engine_threads, args.streams, args.tokens)
        ratio = ours["tok_s_median"] / base["tok_s_median"]
        rounds.append({"ours": ours, "llama_cpp": base, "ratio_median": ratio})
        print(f"round {i}: ours {ours}, llama.cpp {base}, ratio {ratio:.2f}", flush=True)
    rows = [
        "| round | ours tok/s (median, best) | ours ITL p50 ms | llama.cpp tok/s (median, best) "
        "| llama.cpp ITL p50 ms | ours / llama.cpp |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds):
        o, b = r["ours"], r["llama_cpp"]
        rows.append(
            f"| {i} | {o['tok_s_median']:.1f}, {o['tok_s_best']:.1f} | {o['itl_p50_ms']:.1f} "
            f"| {b['tok_s_median']:.1f}, {b['tok_s_best']:.1f} | {b['itl_p50_ms']:.1f} | {r['ratio_median']:.2f}x |"
        )
    overall = statistics.median(r["ratio_median"] for r in rounds)
    md = f"settings {vars(args)}\n\n" + "\n".join(rows) + f"\n\nmedian ratio over rounds: {overall:.2f}x\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"cpp_baseline_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps({"settings": vars(args), "rounds": rounds, "median_ratio": overall}, indent=2))
    print(md)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
