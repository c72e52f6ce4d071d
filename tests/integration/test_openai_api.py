"""The OpenAI-compatible API, through the official ``openai`` client, against a real frontend
process in front of real Triton deployments (aggregated, and disaggregated through the front
model): completions and chat, streaming and not, usage, JSON-schema output, bad input, unknown
model, a client that disconnects mid-stream (its pages come back), an unreachable Triton; greedy
output equals the Triton API's for the same prompt."""

from __future__ import annotations

import json
import time

import openai
import pytest
import requests

from backend.client import stream_generate
from backend.launch.openai_frontend import OpenAIFrontend
from backend.launch.ports import free_port
from tests.conftest import metric_values, wait_pool_free

PROMPT = "The capital of France is"
CHAT = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def agg(aggregated_server, model_dir, tmp_path_factory):
    frontend = OpenAIFrontend(
        aggregated_server.grpc_url,
        model_dir,
        served_model_name="smollm2",
        log_file=tmp_path_factory.mktemp("openai-agg") / "openai.log",
    )
    frontend.start()
    yield aggregated_server, frontend, openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="none", max_retries=0)
    frontend.stop()


@pytest.fixture(scope="module")
def disagg(disagg_server, model_dir, tmp_path_factory):
    frontend = OpenAIFrontend(
        disagg_server.grpc_url, model_dir, log_file=tmp_path_factory.mktemp("openai-disagg") / "openai.log"
    )
    frontend.start()
    yield disagg_server, frontend, openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="none", max_retries=0)
    frontend.stop()


def test_models_and_health(agg):
    _, frontend, client = agg
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert requests.get(f"{frontend.url}/health", timeout=5).json() == {"status": "ok"}


def test_completion_equals_the_triton_api(agg):
    server, _, client = agg
    triton = stream_generate(server.grpc_url, PROMPT, 12, temperature=0.0, ignore_eos=True)
    assert triton.error is None and len(triton.token_ids) == 12
    whole = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].text == triton.text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(
        client.completions.create(
            model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == triton.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(chunks) > 2  # streamed, not one block


def test_chat_streaming_with_usage_equals_the_triton_chat(agg):
    server, _, client = agg
    triton = stream_generate(server.grpc_url, CHAT, 24, temperature=0.0, chat=True)
    assert triton.error is None
    messages = [{"role": "user", "content": CHAT}]
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_completion_tokens=24, temperature=0)
    assert whole.choices[0].message.content == triton.text and whole.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == triton.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert "Paris" in whole.choices[0].message.content


def test_sampling_with_a_seed_repeats(agg):
    _, _, client = agg
    args = dict(model="smollm2", prompt="Once upon a time", max_tokens=16, temperature=0.9, top_p=0.9, seed=7)
    assert client.completions.create(**args).choices[0].text == client.completions.create(**args).choices[0].text


def test_json_schema_output_validates(agg):
    _, _, client = agg
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Lyon", "Marseille"]},
            "country": {"type": "string"},
            "is_capital": {"type": "boolean"},
        },
        "required": ["city", "country", "is_capital"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Describe Paris as JSON: city, country, is_capital."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    data = json.loads(out.choices[0].message.content)
    assert set(data) == {"city", "country", "is_capital"}
    assert data["city"] in ("Paris", "Lyon", "Marseille") and isinstance(data["country"], str)
    assert isinstance(data["is_capital"], bool)
    obj = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].finish_reason in ("stop", "length")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_bad_input_and_unknown_model(agg):
    _, frontend, client = agg
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    assert e.value.body["param"] == "model"
    cases = [
        (dict(prompt="x", max_tokens=4, n=2), "n"),
        (dict(prompt="x", max_tokens=4, temperature=3.0), "temperature"),
        (dict(prompt="x", max_tokens=4, logprobs=6), "logprobs"),  # 0..5 (tests/integration/test_openai_logprobs.py)
        (dict(prompt="x", max_tokens=0), "max_tokens"),  # 0 only with echo
        (dict(prompt="x", max_tokens=100_000), None),  # refused by the model: over its limit
        (dict(prompt="", max_tokens=4), None),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="smollm2", **kwargs)
        assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error", kwargs
        assert e.value.body["param"] == param and e.value.body["message"], (kwargs, e.value.body)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2", messages=[], max_tokens=4)
    bad = requests.post(f"{frontend.url}/v1/completions", data=b"{not json", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    # a streamed request that Triton refuses gets its status too, not a 200 with an error inside
    r = requests.post(
        f"{frontend.url}/v1/completions",
        json={"model": "smollm2", "prompt": "x", "max_tokens": 100_000, "stream": True},
        timeout=30,
    )
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def _disconnect_mid_stream(frontend, model: str) -> int:
    """Stream a long answer, read a few events, drop the connection; returns events read."""
    body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 250, "ignore_eos": True, "stream": True}
    with requests.post(f"{frontend.url}/v1/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                events += 1
            if events >= 3:
                break
    return events


def test_client_disconnect_cancels_and_frees_pages(agg):
    server, frontend, _ = agg
    t0 = time.monotonic()
    assert _disconnect_mid_stream(frontend, "smollm2") == 3
    wait_pool_free(server.metrics_url, "llm", timeout_s=10)  # 250 tokens would take far longer
    assert time.monotonic() - t0 < 12
    deadline = time.monotonic() + 10
    while sum(metric_values(server.metrics_url, "triton_disagg_requests_active", model="llm")) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert sum(metric_values(server.metrics_url, "triton_disagg_requests_active", model="llm")) == 0


def test_disaggregated_greedy_equals_triton_and_disconnect_frees_pages(disagg):
    server, frontend, client = disagg
    triton = stream_generate(server.grpc_url, CHAT, 16, temperature=0.0, chat=True, ignore_eos=True)
    assert triton.error is None and len(triton.token_ids) == 16
    out = client.chat.completions.create(
        model="llm",
        messages=[{"role": "user", "content": CHAT}],
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].message.content == triton.text
    streamed = client.completions.create(
        model="llm", prompt=PROMPT, max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    direct = stream_generate(server.grpc_url, PROMPT, 10, temperature=0.0, ignore_eos=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == direct.text
    assert _disconnect_mid_stream(frontend, "llm") == 3
    for model in ("decode_0", "decode_1", "prefill_0", "prefill_1"):
        wait_pool_free(server.metrics_url, model, timeout_s=15)


def test_unreachable_triton_is_503(model_dir, tmp_path):
    frontend = OpenAIFrontend(f"127.0.0.1:{free_port()}", model_dir, log_file=tmp_path / "openai.log")
    with pytest.raises(TimeoutError):
        frontend.start(timeout_s=8)  # /health stays 503 while Triton is not there
    frontend = OpenAIFrontend(f"127.0.0.1:{free_port()}", model_dir, log_file=tmp_path / "openai2.log")
    frontend.start_process()
    try:
        health = requests.get(f"{frontend.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["type"] == "service_unavailable"
        client = openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="llm", prompt="x", max_tokens=4)
        assert e.value.status_code == 503
    finally:
        frontend.stop()
