"""The one GPU check: correctness and absolute figures of the engine and the KV transfer on one
device, without tritonserver (the GPU machine the project borrows has none).
``scripts/gpu_check.sh`` runs it; CI runs it on the CPU with a tiny model (``--device cpu
--quick``) so that it cannot rot.

Sections (each writes ``<name>.json`` into ``--out``; ``summary.json`` lists them all):

0. ``device_marks``: the engine's device marks (``backend/engine/device_progress.py``) on the
   device: a mark queued behind a long kernel is not done at once and is done after it.
1. ``engine_vs_transformers``: the engine on the device against transformers on the device,
   a randomly initialised Llama-shaped model in fp32 (no weights to carry), several prompts
   at once with chunked prefill: greedy tokens must be equal.
2. ``disagg_transfer``: a prefill engine in a child process and a decode engine here, KV pools
   on the device, pages moved layer by layer by ``fabric_bridge`` over NIXL (UCX; cuda_ipc /
   cuda_copy between processes on one GPU) through the real connector (``NixlKVSender`` /
   ``NixlKVReceiver``, posts gated by the device marks): the received pages' bytes must equal
   the sent pages', and the decode's greedy tokens must equal an aggregated engine's.
   Skipped, with the reason, when NIXL does not import.
3. ``figures``: for a Llama-3.2-1B shape in bf16 (``--quick``: the tiny shape): prefill
   tokens/s of a 2048-token prompt, decode inter-token latency at batch 1/16/64, and (NIXL
   permitting) the KV transfer of that prompt between the two processes: GB/s when the whole
   prompt is posted after the prefill (``stream_layers`` off) and the transfer tail after the
   last layer when posted layer by layer.

Exit status 0 when every correctness check that ran passed.

    python -m perf.gpu_check --device cuda --out /tmp/gpu_check
    python -m perf.gpu_check --device cpu --quick --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.engine.reference import hf_greedy
from backend.engine.remote_admission import admit_remote

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie: bool = False

    def config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=4096,
            tie_word_embeddings=self.tie,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )


TINY = Shape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256)
SMALL = Shape(hidden=256, intermediate=512, layers=4, heads=8, kv_heads=4, vocab=1024)
LLAMA_1B = Shape(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256, tie=True)
SHAPES = {"tiny": TINY, "small": SMALL, "llama-1b": LLAMA_1B}


def random_llama(path: Path, shape: Shape, dtype: torch.dtype, device: str, seed: int = 1234) -> Path:
    """A random Llama checkpoint (lm_head sharpened so greedy choices are not near-ties)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(shape.config())
    with torch.no_grad():
        model.lm_head.weight.mul_(20 if not shape.tie else 1)
    model.to(dtype).save_pretrained(path)
    del model
    return path


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prompts_for(vocab: int, lengths: list[int], seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def engine_config(model: Path, device: str, dtype: str, **kw):
    from backend.engine.config import EngineConfig

    return EngineConfig(model_path=str(model), device=device, dtype=dtype, **kw)


def run_engine(engine, prompts: list[list[int]], n_new: int, prefix: str = "r") -> dict[str, list[int]]:
    from backend.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=n_new, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, params)
    tokens: dict[str, list[int]] = {f"{prefix}{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"{out.req_id}: {out.error}")
            tokens[out.req_id] += out.new_token_ids
    return tokens


def pages_sha256(engine, pages: list[int]) -> str:
    """Hash of the bytes of the given pages, every layer (a TP-1 pool)."""
    kv = engine.kv_cache().shards[0][:, pages].contiguous()
    return hashlib.sha256(kv.view(torch.uint8).cpu().numpy()).hexdigest()


# ---------------------------------------------------------------- 0. device marks
def check_device_marks(args, workdir: Path) -> dict:
    from backend.engine.device_progress import make_progress

    device = torch.device(args.device)
    progress = make_progress(device)
    if device.type != "cuda":
        return {"ok": progress.mark().done(), "note": "CPU: operations run when called, marks are done when made"}
    torch.cuda.synchronize(device)
    with torch.cuda.device(device):
        torch.cuda._sleep(1_000_000_000)  # about half a second of GPU clock cycles
    t0 = time.perf_counter()
    mark = progress.mark()
    queued_s = time.perf_counter() - t0
    early = mark.done()
    completed = mark.wait(30)
    waited_s = time.perf_counter() - t0
    return {
        "ok": not early and completed and waited_s > 0.01,
        "done_right_after_queueing": early,
        "completed": completed,
        "waited_s": waited_s,
        "mark_queue_us": 1e6 * queued_s,
    }


# ---------------------------------------------------------------- 1. engine vs transformers
def check_engine_vs_transformers(args, workdir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from backend.engine.llm_engine import LLMEngine

    shape = TINY if args.quick else SMALL
    model_dir = random_llama(workdir / "check-model", shape, torch.float32, "cpu")
    lengths = [5, 23, 70] if args.quick else [5, 37, 100, 300]
    n_new = 12 if args.quick else 24
    prompts = prompts_for(shape.vocab, lengths)
    engine = LLMEngine(
        engine_config(model_dir, args.device, "float32", kv_cache_tokens=4096, max_num_batched_tokens=64, page_size=16)
    )
    try:
        got = run_engine(engine, prompts, n_new)
    finally:
        engine.close()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    hf = hf.to(args.device).eval()
    expected = {f"r{i}": hf_greedy(hf, p, n_new, args.device) for i, p in enumerate(prompts)}
    del hf
    mismatched = [r for r in expected if got[r] != expected[r]]
    return {
        "ok": not mismatched,
        "shape": shape.__dict__,
        "prompt_lengths": lengths,
        "new_tokens": n_new,
        "mismatched": {r: {"engine": got[r], "transformers": expected[r]} for r in mismatched},
    }


# ---------------------------------------------------------------- 2./3. the two processes
def nixl_importable() -> str | None:
    """None when NIXL imports, else why not."""
    try:
        from fabric_bridge import nixl_api

        nixl_api.load()  # NIXL itself is imported at first use
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _prefill_process(conn, model_dir: str, device: str, dtype: str, engine_kw: dict, stream_layers: bool) -> None:
    """Child: a prefill engine and its NixlKVSender, driven over ``conn``."""
    try:
        from backend.disagg.config import ConnectorConfig
        from backend.disagg.connector import SendRequest
        from backend.disagg.nixl_connector import NixlKVSender
        from backend.engine.llm_engine import LLMEngine
        from backend.engine.outputs import FinishReason

        engine = LLMEngine(engine_config(Path(model_dir), device, dtype, **engine_kw))
        errors = []
        sender = NixlKVSender(
            engine,
            ConnectorConfig(stream_layers=stream_layers, kv_xfer_timeout_s=60),
            f"gpu-check-prefill-{os.getpid()}",
            lambda r, e: errors.append(f"{r}: {e}"),
            lambda request: None,
        )
        conn.send(sender.handshake_payload())
        peer = sender.add_peer(conn.recv())
        while True:
            msg = conn.recv()
            if msg is None:
                break
            req_id, tokens, dst, generation, slot = msg
            sender.add_request(SendRequest(req_id, peer, generation, slot, len(tokens), dst))
            engine.add_request(req_id, tokens, prefill_only=True)
            t0 = time.perf_counter()
            out = None
            while out is None:
                for o in engine.step():
                    out = o
            sync(device)
            t_compute = time.perf_counter() - t0
            freed = {}

            def on_freeable(rid, ok, err, freed=freed, n_pages=len(dst)):
                t_freeable = time.perf_counter()
                src = engine.page_table(rid)[:n_pages]
                freed.update(ok=ok, err=err, sha=pages_sha256(engine, src))
                freed["t"] = t_freeable

            sender.request_finished(out, on_freeable)
            while "t" not in freed:
                time.sleep(0.0005)
            engine.release(req_id)
            conn.send(
                {
                    "req_id": req_id,
                    "ok": freed["ok"] and out.finish_reason == FinishReason.PREFILL_DONE,
                    "err": freed["err"] or out.error or "; ".join(errors) or None,
                    "sha256": freed["sha"],
                    "compute_s": t_compute,
                    "tail_s": freed["t"] - t0 - t_compute,
                }
            )
        sender.close()
        engine.close()
    except Exception:
        conn.send({"fatal": traceback.format_exc()})


class PrefillChild:
    """The prefill process and the decode side's receiver, connected both ways."""

    made = 0

    def __init__(self, decode_engine, model_dir: Path, device: str, dtype: str, engine_kw: dict, stream_layers: bool):
        from backend.disagg.config import ConnectorConfig
        from backend.disagg.nixl_connector import NixlKVReceiver
        from fabric_bridge.layout import KVLayout

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_prefill_process, args=(child, str(model_dir), device, dtype, engine_kw, stream_layers), daemon=True
        )
        self.proc.start()
        self.engine = decode_engine
        PrefillChild.made += 1
        self.receiver = NixlKVReceiver(
            decode_engine, ConnectorConfig(kv_transfer_timeout_s=120), f"gpu-check-decode-{os.getpid()}-{self.made}"
        )
        payload = self._recv()
        self.peer = self.receiver.add_peer(payload)
        self.src_layout = KVLayout.from_dict(payload["layout"])
        self.conn.send(self.receiver.handshake_payload())

    def _recv(self, timeout_s: float = 300):
        if not self.conn.poll(timeout_s):
            raise TimeoutError("the prefill process did not answer")
        msg = self.conn.recv()
        if isinstance(msg, dict) and "fatal" in msg:
            raise RuntimeError("prefill process failed:\n" + msg["fatal"])
        return msg

    def prefill(self, req_id: str, prompt: list[int], params=None) -> dict:
        """Admit the request on the decode engine (its pages), have the child prefill all but its
        last token into them; returns the child's report plus the received pages' hash, the meta
        and the times here. The request then waits for ``engine.kv_loaded`` (or abort + release)."""
        import threading

        n = len(prompt) - 1
        pages = admit_remote(self.engine, req_id, prompt, params)
        dst = pages[: math.ceil(n / self.engine.kv_cache().page_size)]
        ready, got = threading.Event(), {}

        def on_ready(rid, ok, err, meta):
            got.update(ok=ok, err=err, meta=meta, t=time.perf_counter())
            ready.set()

        t0 = time.perf_counter()
        ticket = self.receiver.expect(req_id, n, (self.peer, self.src_layout), on_ready, lambda rid: None)
        self.receiver.started(req_id, ticket.generation)
        self.conn.send((req_id, prompt[:-1], dst, ticket.generation, ticket.slot))
        report = self._recv()
        if not ready.wait(120):
            raise TimeoutError(f"{req_id}: KV never arrived")
        kv = self.engine.kv_cache().shards[0][:, dst]
        report.update(
            received_ok=got["ok"],
            received_err=got["err"],
            received_sha256=pages_sha256(self.engine, dst),
            bytes=kv.numel() * kv.element_size(),
            wall_s=got["t"] - t0,
            meta=None if got["meta"] is None else tuple(t.clone() for t in got["meta"]),
            pages=dst,
        )
        return report

    def close(self) -> None:
        try:
            self.conn.send(None)
        except Exception:
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
        self.receiver.close()


def check_disagg_transfer(args, workdir: Path) -> dict:
    from backend.engine.llm_engine import LLMEngine
    from backend.engine.sampling_params import SamplingParams

    shape = TINY if args.quick else SMALL
    model_dir = workdir / "check-model"
    if not model_dir.exists():
        random_llama(model_dir, shape, torch.float32, "cpu")
    engine_kw = dict(kv_cache_tokens=4096, max_num_batched_tokens=64, page_size=16)
    lengths = [41, 97] if args.quick else [41, 200, 513]
    n_new = 12 if args.quick else 24
    prompts = prompts_for(shape.vocab, lengths, seed=11)

    aggregated = LLMEngine(engine_config(model_dir, args.device, "float32", **engine_kw))
    try:
        expected = run_engine(aggregated, prompts, n_new)
    finally:
        aggregated.close()
    decode = LLMEngine(engine_config(model_dir, args.device, "float32", **engine_kw))
    child = PrefillChild(decode, model_dir, args.device, "float32", engine_kw, stream_layers=True)
    results, ok = [], True
    try:
        for i, prompt in enumerate(prompts):
            req_id = f"r{i}"
            rep = child.prefill(req_id, prompt, SamplingParams(max_tokens=n_new, ignore_eos=True))
            hidden, logits = rep["meta"]
            assert decode.kv_loaded(req_id, hidden, logits)
            tokens = []
            while decode.has_work():
                for out in decode.step():
                    tokens += out.new_token_ids
            same_bytes = rep["sha256"] == rep["received_sha256"]
            same_tokens = tokens == expected[req_id]
            ok &= bool(rep["ok"] and rep["received_ok"] and same_bytes and same_tokens)
            results.append(
                {
                    "prompt_tokens": len(prompt),
                    "sent_ok": rep["ok"],
                    "received_ok": rep["received_ok"],
                    "error": rep["err"] or rep["received_err"],
                    "bytes": rep["bytes"],
                    "bytes_equal": same_bytes,
                    "tokens_equal_aggregated": same_tokens,
                }
            )
    finally:
        child.close()
        decode.close()
    return {"ok": ok, "shape": shape.__dict__, "mem_kind": child.src_layout.mem_kind, "requests": results}


def measure_figures(args, workdir: Path) -> dict:
    from backend.engine.llm_engine import LLMEngine
    from backend.engine.sampling_params import SamplingParams

    quick = args.quick
    shape = SHAPES[args.figures_shape or ("tiny" if quick else "llama-1b")]
    dtype = "float32" if shape is TINY else "bfloat16"
    prompt_len = 64 if quick else 2048
    batches = [1, 4] if quick else [1, 16, 64]
    model_dir = random_llama(workdir / "figures-model", shape, getattr(torch, dtype), args.device)
    figures: dict = {"shape": shape.__dict__, "dtype": dtype, "device": args.device, "prompt_tokens": prompt_len}

    # prefill tokens/s: one prefill-only request of prompt_len tokens in one chunk
    engine = LLMEngine(
        engine_config(
            model_dir,
            args.device,
            dtype,
            kv_cache_tokens=max(prompt_len * 2, max(batches) * 192),
            max_num_batched_tokens=prompt_len,
            max_num_seqs=max(batches),
            page_size=16,
        )
    )
    try:
        times = []
        for rep in range(3 if quick else 4):
            engine.add_request(f"p{rep}", prompts_for(shape.vocab, [prompt_len], seed=rep)[0], prefill_only=True)
            sync(args.device)
            t0 = time.perf_counter()
            engine.step()
            sync(args.device)
            times.append(time.perf_counter() - t0)
            engine.release(f"p{rep}")
        steady = times[1:]  # the first run warms up kernels and allocations
        figures["prefill_s"] = statistics.median(steady)
        figures["prefill_tokens_per_s"] = prompt_len / statistics.median(steady)

        # decode inter-token latency at each batch size: a step's time once every request decodes
        itl = {}
        for b in batches:
            params = SamplingParams(max_tokens=48, ignore_eos=True)  # 3 + 32 steps after the first token
            for i, p in enumerate(prompts_for(shape.vocab, [128 if not quick else 16] * b, seed=100 + b)):
                engine.add_request(f"d{b}-{i}", p, params)
            started: set[str] = set()
            while len(started) < b:  # until every request has its first token (prefills done)
                started.update(o.req_id for o in engine.step() if o.new_token_ids)
            for _ in range(3):
                engine.step()  # every request is decoding now; warm up
            steps = []
            for _ in range(10 if quick else 32):
                sync(args.device)
                t0 = time.perf_counter()
                engine.step()
                sync(args.device)
                steps.append(time.perf_counter() - t0)
            for i in range(b):
                engine.abort(f"d{b}-{i}")
            itl[str(b)] = {"p50_ms": 1e3 * statistics.median(steps), "max_ms": 1e3 * max(steps)}
        figures["decode_itl"] = itl
    finally:
        engine.close()

    why = nixl_importable()
    if why is not None:
        figures["transfer"] = {"skipped": f"NIXL does not import here: {why}"}
        print(f"SKIP transfer figures: NIXL does not import here: {why}", flush=True)
        return figures
    transfer = {}
    engine_kw = dict(kv_cache_tokens=prompt_len * 4, max_num_batched_tokens=prompt_len, page_size=16)
    prompt = prompts_for(shape.vocab, [prompt_len + 1], seed=5)[0]
    for stream_layers in (False, True):
        decode = LLMEngine(engine_config(model_dir, args.device, dtype, **engine_kw))
        child = PrefillChild(decode, model_dir, args.device, dtype, engine_kw, stream_layers)
        try:
            reps = []
            for rep in range(3):
                r = child.prefill(f"t{rep}", prompt)
                decode.abort(f"t{rep}")
                decode.release(f"t{rep}")
                reps.append(r)
            steady = reps[1:]
            key = "layer_by_layer" if stream_layers else "after_prefill"
            transfer[key] = {
                "bytes": steady[0]["bytes"],
                "bytes_equal": all(r["sha256"] == r["received_sha256"] for r in reps),
                "prefill_compute_s": statistics.median(r["compute_s"] for r in steady),
                "tail_s": statistics.median(r["tail_s"] for r in steady),
                "decode_side_wall_s": statistics.median(r["wall_s"] for r in steady),
            }
            if not stream_layers:  # everything is posted after the prefill: the tail is the transfer
                transfer[key]["gb_per_s"] = steady[0]["bytes"] / transfer[key]["tail_s"] / 1e9
        finally:
            child.close()
            decode.close()
    figures["transfer"] = transfer
    figures["ok"] = all(t["bytes_equal"] for t in transfer.values())
    return figures


def device_info(device: str) -> dict:
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    else:
        info.update(cpu_count=os.cpu_count())
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--quick", action="store_true", help="the tiny shapes (CI on the CPU)")
    ap.add_argument("--out", required=True, help="folder for the JSON results")
    ap.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    ap.add_argument(
        "--figures-shape", choices=sorted(SHAPES), default=None, help="model shape of the figures (default: llama-1b)"
    )
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = {
        "device_marks": check_device_marks,
        "engine_vs_transformers": check_engine_vs_transformers,
        "disagg_transfer": check_disagg_transfer,
        "figures": measure_figures,
    }
    wanted = [s for s in args.only.split(",") if s] or list(sections)
    unknown = set(wanted) - set(sections)
    if unknown:
        ap.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    summary = {"device": device_info(args.device), "quick": args.quick, "sections": {}}
    failed = False
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name in wanted:
            t0 = time.perf_counter()
            print(f"== {name}", flush=True)
            if name == "disagg_transfer" and (why := nixl_importable()) is not None:
                result = {"skipped": f"NIXL does not import here: {why}"}
                print(f"SKIP {name}: {result['skipped']}", flush=True)
            else:
                try:
                    result = sections[name](args, Path(tmp))
                except Exception:
                    result = {"ok": False, "error": traceback.format_exc()}
            result["seconds"] = round(time.perf_counter() - t0, 2)
            failed |= result.get("ok") is False
            (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
            summary["sections"][name] = {k: v for k, v in result.items() if k in ("ok", "skipped", "seconds", "error")}
            print(json.dumps(result, indent=2, default=str), flush=True)
    summary["ok"] = not failed
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"gpu_check: {'PASS' if not failed else 'FAIL'}; results in {out}", flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
