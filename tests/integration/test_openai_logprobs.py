"""Log-probabilities, echo and token-id prompts through the OpenAI API, end to end: a real
frontend process in front of a real tritonserver (aggregated; one check through the
disaggregated front; a stream with echo and logprobs that moves when its decode instance is
killed is in ``test_two_servers.py``). Prompt scoring (``echo`` with ``max_tokens`` 0, and lm-eval's
``local-completions`` payload) and a generated continuation give the log-probabilities
transformers computes on the same model in float32 (within 1e-3); chat ``logprobs`` and
``top_logprobs``; streamed chunks carry their tokens' log-probabilities; the 400s name the
field."""

from __future__ import annotations

import json

import openai
import pytest
import requests
import torch

from backend.launch.openai_frontend import OpenAIFrontend

CONTEXT = "The capital of France is"
CONTINUATION = " Paris, and the capital of Italy is Rome."
TOL = 1e-3


@pytest.fixture(scope="module")
def agg(aggregated_server, model_dir, tmp_path_factory):
    frontend = OpenAIFrontend(
        aggregated_server.grpc_url,
        model_dir,
        served_model_name="smollm2",
        log_file=tmp_path_factory.mktemp("openai-logprobs") / "openai.log",
    )
    frontend.start()
    yield frontend, openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="none", max_retries=0)
    frontend.stop()


@pytest.fixture(scope="module")
def hf(hf_model):
    return hf_model


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: log_softmax of the logits predicting tokens 2..P, float32."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return logits[:-1].log_softmax(-1)


def token_logprobs(table: torch.Tensor, ids: list[int]) -> list[float]:
    """The log-probability of each of tokens 2..P of ``ids``."""
    return [float(table[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def post(frontend, path: str, body: dict) -> requests.Response:
    return requests.post(f"{frontend.url}{path}", json=body, timeout=120)


def lm_eval_parse_logprobs(body: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval 0.4's ``local-completions`` reading of an answer (``parse_logprobs``)."""
    choice = body["choices"][0]
    lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(lps), all(tok == max(top.values()) for tok, top in zip(lps, tops, strict=True))


def test_echo_with_max_tokens_zero_scores_the_prompt_as_transformers_does(agg, hf, tokenizer):
    frontend, _ = agg
    ids = tokenizer.encode(CONTEXT + CONTINUATION, add_special_tokens=False)
    r = post(
        frontend, "/v1/completions", {"model": "smollm2", "prompt": [ids], "max_tokens": 0, "echo": True, "logprobs": 3}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 0
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    table = hf_logprobs(hf, ids)
    expected = token_logprobs(table, ids)
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=TOL)
    for i, top in enumerate(lp["top_logprobs"][1:]):
        best = table[i].topk(3)
        assert 3 <= len(top) <= 4  # the 3 most likely and the prompt's own token
        assert max(top.values()) == pytest.approx(float(best.values[0]), abs=TOL)
        assert tokenizer.decode([int(best.indices[0])]) in top
    # the same with the prompt as text: the same tokens, the same numbers
    text = post(
        frontend,
        "/v1/completions",
        {"model": "smollm2", "prompt": CONTEXT + CONTINUATION, "max_tokens": 0, "echo": True, "logprobs": 0},
    ).json()["choices"][0]
    assert text["text"] == CONTEXT + CONTINUATION and text["logprobs"]["tokens"] == lp["tokens"]
    assert text["logprobs"]["token_logprobs"][1:] == pytest.approx(expected, abs=TOL)
    assert all(len(top) == 1 for top in text["logprobs"]["top_logprobs"][1:])


def test_lm_eval_loglikelihood_payload(agg, hf, tokenizer):
    """What lm-eval's local-completions sends for loglikelihood, and reads back."""
    frontend, _ = agg
    context = tokenizer.encode(CONTEXT, add_special_tokens=False)
    table = hf_logprobs(hf, context + tokenizer.encode(CONTINUATION, add_special_tokens=False))
    greedy = [int(table[len(context) - 1].argmax())]  # the model's own next token: a greedy continuation
    for continuation, is_greedy in [(tokenizer.encode(CONTINUATION, add_special_tokens=False), False), (greedy, True)]:
        ids = context + continuation
        payload = {"model": "smollm2", "prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True}
        r = post(frontend, "/v1/completions", {**payload, "temperature": 0, "seed": 1234})
        assert r.status_code == 200, r.text
        body = r.json()
        lp = body["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 and body["usage"]["completion_tokens"] == 1
        total, greedy_seen = lm_eval_parse_logprobs(body, len(context))
        reference = sum(token_logprobs(hf_logprobs(hf, ids), ids)[len(context) - 1 :])
        assert total == pytest.approx(reference, abs=TOL), continuation
        assert greedy_seen is is_greedy
        # the generated token is greedy (temperature 0): its logprob is its map's largest, exactly
        assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())


def test_a_generated_continuation_sums_to_the_transformers_log_likelihood(agg, hf, tokenizer):
    frontend, client = agg
    prompt = tokenizer.encode(CONTEXT, add_special_tokens=False)
    out = client.completions.create(
        model="smollm2", prompt=CONTEXT, max_tokens=10, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    choice = out.choices[0]
    assert choice.logprobs is not None and len(choice.logprobs.tokens) == 10 == out.usage.completion_tokens
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.text_offset[0] == 0
    # the greedy continuation, token by token, as transformers sees it
    ids = list(prompt)
    for _ in range(10):
        ids.append(int(hf_logprobs(hf, [*ids, 0])[-1].argmax()))
    generated = ids[len(prompt) :]
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in generated]
    reference = token_logprobs(hf_logprobs(hf, ids), ids)[len(prompt) - 1 :]
    assert choice.logprobs.token_logprobs == pytest.approx(reference, abs=TOL)
    assert sum(choice.logprobs.token_logprobs) == pytest.approx(sum(reference), abs=TOL)
    for tok, lp, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
        assert top[tok] == lp == max(top.values()) and len(top) == 2
    # the token ids as the prompt: the same answer
    by_ids = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == choice.text


def test_chat_logprobs_and_top_logprobs(agg, tokenizer):
    _, client = agg
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    out = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 12
    # past the end (ignore_eos) the special tokens are in the logprobs, not in the text
    special = set(tokenizer.all_special_tokens)
    assert "".join(e.token for e in content if e.token not in special) == out.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    plain = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    streamed = list(
        client.chat.completions.create(
            model="smollm2",
            messages=messages,
            max_tokens=12,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in content]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content], abs=TOL)


def test_streamed_completion_with_echo_carries_the_prompt_first_then_each_tokens(agg, tokenizer):
    frontend, _ = agg
    body = {
        "model": "smollm2",
        "prompt": CONTEXT,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
        "ignore_eos": True,
    }
    whole = post(frontend, "/v1/completions", body).json()["choices"][0]
    with requests.post(f"{frontend.url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[len(b"data: ") :] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    choices = [json.loads(line)["choices"][0] for line in lines[:-1]]
    prompt_ids = tokenizer.encode(CONTEXT, add_special_tokens=False)
    assert choices[0]["text"] == CONTEXT and len(choices[0]["logprobs"]["tokens"]) == len(prompt_ids)
    assert choices[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in choices) == whole["text"]
    pieces = [c["logprobs"] for c in choices if c["logprobs"]]
    assert len(pieces) > 2  # streamed: the prompt, then the tokens in several chunks
    tokens = [t for p in pieces for t in p["tokens"]]
    assert tokens == whole["logprobs"]["tokens"]
    streamed = [v for p in pieces for v in p["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=TOL)
    assert [o for p in pieces for o in p["text_offset"]] == whole["logprobs"]["text_offset"]


CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
        ("/v1/completions", {"prompt": [[1, 2], [3, 4]], "echo": True, "logprobs": 1}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logprobs": 1, "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "n": 2}, "n"),
    ],
)
def test_400_names_the_field(agg, path, body, param):
    frontend, _ = agg
    r = post(frontend, path, {"model": "smollm2", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"], error


def test_a_token_id_outside_the_vocabulary_is_a_400(agg):
    frontend, _ = agg
    r = post(frontend, "/v1/completions", {"model": "smollm2", "prompt": [1, 10**7], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_disaggregated_scoring_equals_aggregated(agg, disagg_server, model_dir, tokenizer, tmp_path):
    """Through the front model (prefill and decode instances): lm-eval's payload gives the same
    log-probabilities as the aggregated model."""
    frontend = OpenAIFrontend(disagg_server.grpc_url, model_dir, log_file=tmp_path / "openai.log")
    frontend.start()
    try:
        ids = tokenizer.encode(CONTEXT + CONTINUATION, add_special_tokens=False)
        payload = {"prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
        split = post(frontend, "/v1/completions", {"model": "llm", **payload})
        assert split.status_code == 200, split.text
        whole = post(agg[0], "/v1/completions", {"model": "smollm2", **payload}).json()
        got, want = split.json()["choices"][0]["logprobs"], whole["choices"][0]["logprobs"]
        assert got["tokens"] == want["tokens"] and got["token_logprobs"][0] is None
        assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=TOL)
        chat = post(
            frontend,
            "/v1/chat/completions",
            {"model": "llm", "messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2},
        ).json()
        assert len(chat["choices"][0]["logprobs"]["content"]) == chat["usage"]["completion_tokens"]
    finally:
        frontend.stop()


# ------------------------------------------------------------------ routed across servers, moved
