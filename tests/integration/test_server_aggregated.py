"""The aggregated ``llm`` model on a real tritonserver: streaming, HTTP generate, bad input, cancel."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import requests

from backend.client import stream_generate
from tests.conftest import wait_pool_free

PROMPT = "What is the capital of France?"


@pytest.fixture(autouse=True)
def pool_back_to_free(aggregated_server):
    yield
    wait_pool_free(aggregated_server.metrics_url, "llm")


def test_grpc_stream_answers_paris(aggregated_server):
    res = stream_generate(aggregated_server.grpc_url, PROMPT, 32, chat=True)
    assert res.error is None, res.error
    assert "Paris" in res.text
    assert len(res.chunks) > 3, "expected a streamed answer in several responses"
    assert res.finish_reason in ("stop", "length")


def test_server_greedy_matches_transformers(aggregated_server, hf_model, tokenizer):
    import torch

    prompt = "The three primary colors are"
    res = stream_generate(aggregated_server.grpc_url, prompt, 20, ignore_eos=True)
    assert res.error is None, res.error
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.inference_mode():
        ref = hf_model.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20)[0, ids.shape[1] :]
    assert res.token_ids == ref.tolist()


def test_http_generate_stream_answers_paris(aggregated_server):
    r = requests.post(
        f"http://{aggregated_server.http_url}/v2/models/llm/generate_stream",
        json={"text_input": PROMPT, "max_tokens": 32, "stream": True, "apply_chat_template": True},
        stream=True,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    events = [json.loads(line[len(b"data: ") :]) for line in r.iter_lines() if line.startswith(b"data: ")]
    assert len(events) > 3
    assert "Paris" in "".join(e["text_output"] for e in events)


def test_http_generate_non_streaming(aggregated_server):
    r = requests.post(
        f"http://{aggregated_server.http_url}/v2/models/llm/generate",
        json={"text_input": PROMPT, "max_tokens": 32, "apply_chat_template": True},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["text_output"] and body["num_output_tokens"] > 3


def test_http_bad_input_is_a_400_with_its_kind(aggregated_server):
    r = requests.post(
        f"http://{aggregated_server.http_url}/v2/models/llm/generate",
        json={"text_input": "hello", "max_tokens": 8, "top_p": 0.0},
        timeout=60,
    )
    assert r.status_code == 400 and "[bad_request]" in r.text and "top_p" in r.text, (r.status_code, r.text)


def test_grpc_non_streaming_single_response(aggregated_server):
    res = stream_generate(aggregated_server.grpc_url, PROMPT, 24, chat=True, stream=False)
    assert res.error is None and len(res.chunks) == 1
    assert "Paris" in res.text


def test_concurrent_requests_match_sequential(aggregated_server):
    prompts = ["Once upon a time", "def fibonacci(n):", "The weather today is", "List three fruits:"]
    seq = [stream_generate(aggregated_server.grpc_url, p, 12, ignore_eos=True).token_ids for p in prompts]
    out = [None] * len(prompts)

    def run(i):
        out[i] = stream_generate(aggregated_server.grpc_url, prompts[i], 12, ignore_eos=True).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert out == seq


def test_stop_words_end_the_output(aggregated_server):
    full = stream_generate(aggregated_server.grpc_url, "Count: 1, 2, 3, 4,", 16, ignore_eos=True)
    assert " 6" in full.text, full.text
    res = stream_generate(aggregated_server.grpc_url, "Count: 1, 2, 3, 4,", 16, ignore_eos=True, stop_words=[" 6"])
    assert res.error is None and res.finish_reason == "stop"
    assert res.text == full.text[: full.text.index(" 6")]


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (dict(prompt="", max_tokens=8), "empty"),
        (dict(prompt="hello", max_tokens=0), "must be > 0"),
        (dict(prompt="hello", max_tokens=100000), "exceeds the configured limit"),
        (dict(prompt="hello " * 9000, max_tokens=8), "exceeds the model context"),
        (dict(prompt="hello", max_tokens=8, top_p=0.0), "top_p"),
        (dict(prompt="hello", max_tokens=8, temperature=float("nan")), "temperature must be >= 0"),
    ],
)
def test_bad_input_gets_clear_error(aggregated_server, kwargs, msg):
    p, n = kwargs.pop("prompt"), kwargs.pop("max_tokens")
    res = stream_generate(aggregated_server.grpc_url, p, n, **kwargs)
    assert res.error is not None and msg in res.error and "[bad_request]" in res.error, res.error
    ok = stream_generate(aggregated_server.grpc_url, "Hi", 4)
    assert ok.error is None and ok.token_ids


def test_missing_and_mistyped_tensors(aggregated_server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from backend.client import build_inputs

    def send(inputs):
        errors = []
        done = threading.Event()
        c = grpcclient.InferenceServerClient(aggregated_server.grpc_url)

        def cb(result, error):
            if error is not None:
                errors.append(error.message() if isinstance(error, InferenceServerException) else str(error))
            done.set()

        c.start_stream(callback=cb)
        try:
            c.async_stream_infer("llm", inputs)
            assert done.wait(60), "no response to a bad request"
        finally:
            c.stop_stream()
            c.close()
        return errors

    no_text = [i for i in build_inputs(grpcclient, "x", 4) if i.name() != "text_input"]
    assert any("text_input" in e for e in send(no_text))
    wrong = grpcclient.InferInput("max_tokens", [1], "FP32")
    wrong.set_data_from_numpy(np.array([4.0], np.float32))
    inputs = [i for i in build_inputs(grpcclient, "x", 4) if i.name() != "max_tokens"] + [wrong]
    errs = send(inputs)
    assert errs and "max_tokens" in errs[0] and ("type" in errs[0].lower()), errs
    assert stream_generate(aggregated_server.grpc_url, "Hi", 4).error is None


def test_client_cancel_mid_stream_frees_pages(aggregated_server):
    res = stream_generate(
        aggregated_server.grpc_url,
        "Write a long story about a dragon.",
        200,
        chat=True,
        ignore_eos=True,
        cancel_after=3,
    )
    assert len(res.chunks) == 3
    wait_pool_free(aggregated_server.metrics_url, "llm")
    ok = stream_generate(aggregated_server.grpc_url, PROMPT, 16, chat=True)
    assert ok.error is None and "Paris" in ok.text


def test_metrics_report_pool_and_requests(aggregated_server):
    from tests.conftest import metric_values

    stream_generate(aggregated_server.grpc_url, "Hi", 4)
    url = aggregated_server.metrics_url
    assert metric_values(url, "triton_disagg_kv_pages_total", model="llm")[0] == 4096 // 16
    assert metric_values(url, "triton_disagg_requests_total", model="llm")[0] >= 1


def guided(schema: str) -> dict:
    return {"guided_json": (np.array([schema.encode()], dtype=object), "BYTES")}


def test_slow_grammar_fails_alone_off_the_request_path(aggregated_server):
    """A schema that takes seconds to compile (1500 optional properties) fails with its own
    time limit (``max_grammar_compile_s`` = 1 here) while a plain request sent right after it is
    served at once; an oversized schema is refused; guided decoding works again afterwards."""
    url = aggregated_server.grpc_url
    slow = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1500)}})
    box = {}
    t = threading.Thread(target=lambda: box.update(r=stream_generate(url, "Give JSON.", 8, extra=guided(slow))))
    t0 = time.monotonic()
    t.start()
    time.sleep(0.2)
    plain = stream_generate(url, "Hi", 4, ignore_eos=True)
    plain_s = time.monotonic() - t0
    t.join(60)
    assert plain.error is None and len(plain.token_ids) == 4, plain.error
    assert box["r"].error and "[bad_request]" in box["r"].error and "did not compile within 1 s" in box["r"].error
    assert plain_s < 10, f"a plain request waited {plain_s:.1f}s behind a grammar compile"
    huge = json.dumps({"type": "object", "properties": {f"q{i}": {"type": "string"} for i in range(3000)}})
    refused = stream_generate(url, "Give JSON.", 8, extra=guided(huge))
    assert refused.error and "max_grammar_bytes" in refused.error, refused.error
    small = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    deadline = time.monotonic() + 120  # the slow compile still runs on the compile thread
    while True:
        res = stream_generate(url, "Give JSON.", 16, extra=guided(small))
        if res.error is None or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert res.error is None and json.loads(res.text)["a"] is not None, (res.error, res.text)
