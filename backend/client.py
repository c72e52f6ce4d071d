"""A small Triton client for our models: streamed generation over gRPC, and HTTP generate.

Used by ``triton-disagg generate``, the tests and the benchmarks.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from backend.serving.tensors import LOGPROB_OUTPUTS, PERF_OUTPUT


@dataclass
class GenerationResult:
    text: str = ""
    token_ids: list = field(default_factory=list)
    chunks: list = field(default_factory=list)  # text deltas as they arrived
    times: list = field(default_factory=list)  # arrival time of each response (perf_counter)
    t_start: float = 0.0
    finish_reason: str = ""
    error: str | None = None
    # log-probability outputs (``output_log_probs``, ``prompt_log_probs``, ...), concatenated
    # over the responses (``cum_log_probs``: the last value)
    log_probs: dict = field(default_factory=dict)
    perf: dict | None = None  # the request's figures (``perf_metrics``), when asked with perf_metrics=True

    @property
    def ttft(self) -> float:
        return self.times[0] - self.t_start if self.times else float("nan")


def build_inputs(
    grpcclient,
    prompt,
    max_tokens,
    *,
    stream=True,
    temperature=None,
    top_k=None,
    top_p=None,
    seed=None,
    end_id=None,
    stop_words=None,
    ignore_eos=None,
    chat=False,
    log_probs=None,
    prompt_log_probs=None,
    top_log_probs=None,
    cache_salt=None,
    perf_metrics=None,
    extra: dict | None = None,
):
    """``prompt``: text, or a list of token ids (sent as ``input_ids``); ``cache_salt``: the
    request's prefix-cache tenant; ``perf_metrics``: ask for its figures in its last response."""

    def tensor(name, arr, dtype):
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    if isinstance(prompt, list):
        first = tensor("input_ids", np.array(prompt, dtype=np.int32), "INT32")
    else:
        text = prompt.encode("utf-8") if isinstance(prompt, str) else prompt
        first = tensor("text_input", np.array([text], dtype=object), "BYTES")
    ins = [
        first,
        tensor("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
        tensor("stream", np.array([stream], dtype=bool), "BOOL"),
    ]
    optional = [
        ("temperature", temperature, np.float32, "FP32"),
        ("top_k", top_k, np.int32, "INT32"),
        ("top_p", top_p, np.float32, "FP32"),
        ("random_seed", seed, np.uint64, "UINT64"),
        ("end_id", end_id, np.int32, "INT32"),
        ("ignore_eos", ignore_eos, bool, "BOOL"),
        ("apply_chat_template", chat or None, bool, "BOOL"),
        ("return_log_probs", log_probs, bool, "BOOL"),
        ("return_prompt_log_probs", prompt_log_probs, bool, "BOOL"),
        ("num_top_log_probs", top_log_probs, np.int32, "INT32"),
        ("return_perf_metrics", perf_metrics, bool, "BOOL"),
    ]
    for name, value, np_t, tr_t in optional:
        if value is not None:
            ins.append(tensor(name, np.array([value], dtype=np_t), tr_t))
    if cache_salt:
        ins.append(tensor("cache_salt", np.array([cache_salt.encode()], dtype=object), "BYTES"))
    if stop_words:
        ins.append(tensor("stop_words", np.array([w.encode() for w in stop_words], dtype=object), "BYTES"))
    for name, (arr, tr_t) in (extra or {}).items():
        ins.append(tensor(name, arr, tr_t))
    return ins


def stream_generate(
    url: str,
    prompt: str | list[int],
    max_tokens: int,
    *,
    model: str = "llm",
    on_text: Callable[[str], None] | None = None,
    timeout_s: float = 300.0,
    cancel_after: int | None = None,
    cancel_after_s: float | None = None,
    traceparent: str = "",
    **kw,
) -> GenerationResult:
    """Stream one request over gRPC; ``cancel_after=n`` cancels it after n responses,
    ``cancel_after_s`` after that many seconds (responses or not). ``traceparent``: the caller's
    W3C trace context, sent as gRPC metadata (a traced deployment's spans join that trace)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    res = GenerationResult()
    ended = False  # the final response (or an error) arrived: nothing left to cancel
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(
            callback=lambda result, error: q.put((result, error, time.perf_counter())),
            headers={"traceparent": traceparent} if traceparent else None,
        )
        res.t_start = time.perf_counter()
        client.async_stream_infer(
            model, build_inputs(grpcclient, prompt, max_tokens, **kw), enable_empty_final_response=True
        )
        deadline = time.monotonic() + (timeout_s if cancel_after_s is None else cancel_after_s)
        while True:
            try:
                result, error, t = q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                if cancel_after_s is None:
                    res.error = f"timed out after {timeout_s}s"
                break
            if error is not None:
                res.error = error.message() if isinstance(error, InferenceServerException) else str(error)
                ended = True
                break
            resp = result.get_response()
            for name in LOGPROB_OUTPUTS:
                arr = result.as_numpy(name)
                if arr is not None:
                    values = arr.reshape(-1).tolist()
                    res.log_probs[name] = values if name == "cum_log_probs" else res.log_probs.get(name, []) + values
            perf = result.as_numpy(PERF_OUTPUT)
            if perf is not None and perf.size:
                res.perf = json.loads(perf.reshape(-1)[0])
            out = result.as_numpy("text_output")
            if out is not None and out.size:
                delta = out.reshape(-1)[0].decode("utf-8")
                ids = result.as_numpy("output_token_ids")
                res.token_ids.extend([] if ids is None else ids.tolist())
                res.chunks.append(delta)
                res.times.append(t)
                res.text += delta
                fr = result.as_numpy("finish_reason")
                if fr is not None and fr.size:
                    res.finish_reason = fr.reshape(-1)[0].decode() or res.finish_reason
                if on_text and delta:
                    on_text(delta)
                if cancel_after is not None and len(res.times) >= cancel_after:
                    break
            final = resp.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                ended = True
                break
    finally:
        # Cancel only a request still running. Cancelling a stream whose final response is still
        # being written leaves that response in Triton's gRPC handler: it holds the model, which
        # then cannot unload (the server's stop runs into its exit timeout).
        client.stop_stream(cancel_requests=not ended)
        client.close()
    return res


class ConcurrentStreams:
    """Requests streamed at once over gRPC (:func:`stream_generate`), one thread each:
    ``received[i]`` counts request i's text deltas as they arrive (to act while they stream: kill an
    instance, drain one); :meth:`join` waits for them and gives their results, in order."""

    def __init__(self, url: str, prompts: Sequence[str | list[int]], max_tokens: int, timeout_s: float = 300.0, **kw):
        self.received = [0] * len(prompts)
        self.results: list[GenerationResult | None] = [None] * len(prompts)
        self.timeout_s = timeout_s

        def run(i: int) -> None:
            def on_text(_delta: str) -> None:
                self.received[i] += 1

            self.results[i] = stream_generate(url, prompts[i], max_tokens, on_text=on_text, timeout_s=timeout_s, **kw)

        self.threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in self.threads:
            t.start()

    def join(self) -> list[GenerationResult | None]:
        for t in self.threads:
            t.join(self.timeout_s)
        return self.results
