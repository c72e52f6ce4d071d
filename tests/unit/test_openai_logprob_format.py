"""Log-probabilities, echo and token-id prompts in the OpenAI frontend, without a server: the
request schema, the Triton tensors asked for and the responses parsed (``triton_stream.py``), the
OpenAI shapes built from scripted Triton responses through the real ASGI app (a fake Triton and
a fake tokenizer), streaming, the 400s, lm-eval's ``local-completions`` reading of the answer,
and a request that moves to another decode instance (the prompt's log-probabilities once)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from starlette.testclient import TestClient

from backend.cluster.records import InstanceRecord
from backend.engine.cache_summary import CacheSummary, page_key
from backend.engine.outputs import ErrorKind
from backend.engine.page_allocator import page_hashes
from backend.openai.app import FrontendConfig, build_app
from backend.openai.fleet import DecodeFleet
from backend.openai.logprobs import CompletionLogprobs, TokenTexts
from backend.openai.router import Router
from backend.openai.schemas import ChatCompletionRequest, CompletionRequest, UnsupportedField
from backend.openai.triton_stream import Delta, GenerationError, GenerationParams, StreamLost, build_inputs, parse_delta

# id -> (text of the id alone, its tokenizer piece)
VOCAB = {
    1: ("The", "The"),
    2: (" capital", "Ġcapital"),
    3: (" of", "Ġof"),
    4: (" France", "ĠFrance"),
    5: (" is", "Ġis"),
    6: (" Paris", "ĠParis"),
    7: (".", "."),
    8: ("<|im_end|>", "<|im_end|>"),
    9: ("\ufffd", "<0xE2>"),  # sentencepiece byte fallback: a part of a character
    10: ("\ufffd", "ãģ"),  # byte-level BPE: b"\xe3\x81", a part of a character
    11: (" Lyon", "ĠLyon"),
    12: (" London", "ĠLondon"),
    13: (" Paris", "ĠParis"),  # another id with the same text as 6
}


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(VOCAB[i][0] for i in ids)

    def convert_ids_to_tokens(self, i):
        return VOCAB[i][1]

    def encode(self, text, add_special_tokens=False):
        return [1, 2, 3, 4, 5]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class FakeTriton:
    """Answers every request with the scripted deltas; records what each request asked."""

    def __init__(self, deltas: list[Delta] | None = None, error: GenerationError | None = None):
        self.deltas, self.error = deltas or [], error
        self.calls: list[tuple[str | list[int], GenerationParams]] = []

    async def generate(self, model, prompt, params, resume_token_ids=None, traceparent=""):
        self.calls.append((prompt, params))
        if self.error is not None:
            raise self.error
        for d in self.deltas:
            yield d

    async def ready(self, model):
        return True

    async def close(self):
        pass


def client(triton: FakeTriton, tokenizer: object | None = FakeTokenizer()) -> TestClient:
    app = build_app(FrontendConfig("unused:1", tokenizer=None), triton_stream=triton, tokenizer_obj=tokenizer)  # type: ignore[arg-type]
    return TestClient(app)


def events(text: str) -> list[dict]:
    """The JSON events of an SSE body (``[DONE]`` last)."""
    lines = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


PROMPT_IDS = [1, 2, 3, 4, 5]  # "The capital of France is"
PROMPT_LPS = [-5.0, -0.25, -1.5, -0.5]  # tokens 2..5
# most likely first: positions 2..5; " of" (3) and " is" (5) are the greedy ones
PROMPT_TOP = [[(12, -1.0)], [(3, -0.25)], [(11, -0.125)], [(5, -0.5)]]


def scoring_delta(outputs: list[int] | None = None, k: int = 1) -> Delta:
    """The one final response of a request that scores its prompt (and generated ``outputs``)."""
    outputs = outputs or []
    return Delta(
        text="".join(VOCAB[t][0] for t in outputs),
        num_input_tokens=5,
        num_output_tokens=len(outputs),
        finish_reason="length",
        token_ids=outputs,
        log_probs=[-0.75] * len(outputs) if outputs else None,
        top_log_probs=[[(t, -0.75)] * k for t in outputs] if outputs else None,
        prompt_token_ids=PROMPT_IDS,
        prompt_log_probs=PROMPT_LPS,
        prompt_top_log_probs=[row * k for row in PROMPT_TOP],
    )


def lm_eval_parse_logprobs(body: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm-eval 0.4's ``local-completions`` reads of an answer (``parse_logprobs``)."""
    choice = body["choices"][0]
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs, strict=True))
    return sum(token_logprobs), is_greedy


# ------------------------------------------------------------------ the request schema


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("The capital", "The capital"),
        (["The capital"], "The capital"),
        ([1, 2, 3], [1, 2, 3]),
        ([[1, 2, 3]], [1, 2, 3]),
    ],
)
def test_a_completion_prompt_is_text_or_token_ids(prompt, expected):
    assert CompletionRequest(model="m", prompt=prompt).prompt_input() == expected


@pytest.mark.parametrize("prompt", [[[1], [2]], ["a", "b"], [], [[]], [-3, 4]])
def test_more_than_one_prompt_or_no_token_is_refused_naming_prompt(prompt):
    with pytest.raises(UnsupportedField) as e:
        CompletionRequest(model="m", prompt=prompt).prompt_input()
    assert e.value.param == "prompt"


def test_max_tokens_zero_only_with_echo_and_chat_top_logprobs_only_with_logprobs():
    with pytest.raises(UnsupportedField) as e:
        CompletionRequest(model="m", prompt="x", max_tokens=0).check_supported()
    assert e.value.param == "max_tokens" and "echo" in str(e.value)
    scoring = CompletionRequest(model="m", prompt="x", max_tokens=0, echo=True)
    scoring.check_supported()
    assert scoring.output_limit() == 0
    assert CompletionRequest(model="m", prompt="x").output_limit() == 16
    with pytest.raises(UnsupportedField) as e:
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], top_logprobs=2).check_supported()
    assert e.value.param == "top_logprobs"
    ok = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=20)
    ok.check_supported()
    assert ok.top_logprobs == 20


# ------------------------------------------------------------------ Triton tensors


def test_the_request_asks_triton_for_what_it_needs():
    params = GenerationParams(max_tokens=0, temperature=0.0, prompt_log_probs=True, num_top_log_probs=3)
    ins = build_inputs([5, 6, 7], params)
    assert "text_input" not in ins and ins["input_ids"].dtype == np.int32 and ins["input_ids"].shape == (3,)
    assert set(ins) >= {"return_prompt_log_probs", "num_top_log_probs", "max_tokens"}
    assert "return_log_probs" not in ins
    plain = set(build_inputs("text", GenerationParams(max_tokens=4, temperature=1.0)))
    assert "text_input" in plain and not plain & {"input_ids", "return_log_probs", "num_top_log_probs"}
    # k without any log-probabilities asked asks for nothing
    only_k = GenerationParams(max_tokens=4, temperature=1.0, num_top_log_probs=2)
    assert "num_top_log_probs" not in build_inputs("text", only_k)


def test_a_triton_response_parses_with_its_log_probabilities():
    result = dict(
        text_output=np.array([b" Paris."], dtype=object),
        output_token_ids=np.array([6, 7], dtype=np.int32),
        num_input_tokens=np.array([5], dtype=np.int32),
        num_output_tokens=np.array([2], dtype=np.int32),
        finish_reason=np.array([b""], dtype=object),
        output_log_probs=np.array([-0.5, -0.25], dtype=np.float32),
        cum_log_probs=np.array([-0.75], dtype=np.float32),
        output_top_log_probs=np.array([-0.5, -1.0, -0.25, -3.0], dtype=np.float32),
        output_top_token_ids=np.array([6, 11, 7, 8], dtype=np.int32),
        prompt_token_ids=np.array([1, 2, 3], dtype=np.int32),
        prompt_log_probs=np.array([-2.0, -0.125], dtype=np.float32),
        prompt_top_log_probs=np.array([-1.0, -2.0, -0.125, -4.0], dtype=np.float32),
        prompt_top_token_ids=np.array([12, 2, 3, 4], dtype=np.int32),
    )
    d = parse_delta(result)
    assert d.text == " Paris." and d.token_ids == [6, 7] and d.finish_reason is None
    assert d.log_probs == [-0.5, -0.25]
    assert d.top_log_probs == [[(6, -0.5), (11, -1.0)], [(7, -0.25), (8, -3.0)]]
    assert d.prompt_token_ids == [1, 2, 3] and d.prompt_log_probs == [-2.0, -0.125]
    assert d.prompt_top_log_probs == [[(12, -1.0), (2, -2.0)], [(3, -0.125), (4, -4.0)]]
    plain = parse_delta(dict(output_token_ids=np.array([6], dtype=np.int32)))
    assert plain.log_probs is None and plain.top_log_probs is None and plain.prompt_token_ids is None
    bad = dict(
        output_token_ids=np.array([6, 7], dtype=np.int32),
        output_top_log_probs=np.array([-0.5, -1.0, -0.25], dtype=np.float32),
        output_top_token_ids=np.array([6, 11, 7], dtype=np.int32),
    )
    with pytest.raises(GenerationError, match="output_top_token_ids"):
        parse_delta(bad)


# ------------------------------------------------------------------ token texts


def test_token_texts_and_bytes():
    texts = TokenTexts(FakeTokenizer())
    assert texts.text(6) == " Paris" and texts.bytes_of(6) == list(b" Paris")
    assert texts.bytes_of(9) == [0xE2]  # the byte the piece names, not U+FFFD's
    assert texts.bytes_of(10) == [0xE3, 0x81]  # byte-level BPE's alphabet
    assert texts.bytes_of(8) == list(b"<|im_end|>")


def test_top_logprobs_hold_the_chosen_token_and_keep_the_likelier_of_two_same_texts():
    lp = CompletionLogprobs(TokenTexts(FakeTokenizer()))
    d = Delta(" London Paris", 3, 2, None, [12, 13], [-4.0, -2.0], [[(6, -0.5), (11, -1.0)], [(6, -0.25), (12, -3.0)]])
    piece = lp.output(d)
    assert piece["tokens"] == [" London", " Paris"] and piece["token_logprobs"] == [-4.0, -2.0]
    # the chosen token (12) is not among the top 2: k + 1 entries
    assert piece["top_logprobs"][0] == {" Paris": -0.5, " Lyon": -1.0, " London": -4.0}
    # id 13 reads " Paris" like the top token 6: one entry, the likelier value
    assert piece["top_logprobs"][1] == {" Paris": -0.25, " London": -3.0}
    assert piece["text_offset"] == [0, 7]
    assert lp.offset == len(d.text)
    with pytest.raises(ValueError, match="log-probabilities"):
        lp.output(Delta("x", 3, 1, None, [6], None))


# ------------------------------------------------------------------ completions through the app


def test_lm_eval_loglikelihood_request():
    """lm-eval's payload: the context + continuation as token ids, one token generated."""
    triton = FakeTriton([scoring_delta([7])])
    payload = {"model": "llm", "prompt": [PROMPT_IDS], "max_tokens": 1, "logprobs": 1, "echo": True}
    r = client(triton).post("/v1/completions", json={**payload, "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt, params = triton.calls[0]
    assert prompt == PROMPT_IDS and params.max_tokens == 1 and params.seed == 1234 and params.temperature == 0
    assert params.log_probs and params.prompt_log_probs and params.num_top_log_probs == 1
    choice = body["choices"][0]
    assert choice["text"] == "The capital of France is."  # the prompt decoded, then the output
    lp = choice["logprobs"]
    assert lp["tokens"] == ["The", " capital", " of", " France", " is", "."]
    assert lp["token_logprobs"] == [None, *PROMPT_LPS, -0.75]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {" London": -1.0, " capital": -5.0}
    assert lp["top_logprobs"][5] == {".": -0.75}
    assert lp["text_offset"] == [0, 3, 11, 14, 21, 24]
    # context "The capital" (2 tokens), continuation " of France is": " France" is not greedy
    assert lm_eval_parse_logprobs(body, 2) == (-0.25 + -1.5 + -0.5, False)
    # context "The capital", continuation " of": greedy
    assert lm_eval_parse_logprobs({"choices": [{**choice, "logprobs": _cut(lp, 3)}]}, 2) == (-0.25, True)
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}


def _cut(lp: dict, n: int) -> dict:
    """The logprobs of the first n tokens and the last one (a shorter prompt, same output)."""
    return {k: v[:n] + v[-1:] for k, v in lp.items()}


def test_echo_with_max_tokens_zero_scores_the_prompt():
    triton = FakeTriton([scoring_delta(k=2)])
    body = {"model": "llm", "prompt": "The capital of France is", "max_tokens": 0, "echo": True, "logprobs": 2}
    r = client(triton).post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    _, params = triton.calls[0]
    assert params.max_tokens == 0 and params.prompt_log_probs and not params.log_probs and params.num_top_log_probs == 2
    choice = r.json()["choices"][0]
    assert choice["text"] == "The capital of France is" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, *PROMPT_LPS]
    assert len(choice["logprobs"]["tokens"]) == 5 and r.json()["usage"]["completion_tokens"] == 0
    # echo without logprobs: text only, but Triton is still asked to score (max_tokens 0 needs it)
    triton = FakeTriton([scoring_delta()])
    r = client(triton).post("/v1/completions", json={**body, "logprobs": None})
    assert r.json()["choices"][0]["logprobs"] is None and r.json()["choices"][0]["text"] == "The capital of France is"
    assert triton.calls[0][1].prompt_log_probs and triton.calls[0][1].num_top_log_probs == 0


def test_logprobs_without_echo_and_without_logprobs():
    deltas = [
        Delta(" Paris", 5, 1, None, [6], [-0.5], [[(6, -0.5)]]),
        Delta("", 5, 2, None, [9], [-1.0], [[(9, -1.0)]]),  # part of a character: no text yet
        Delta("é.", 5, 3, "length", [10, 7], [-2.0, -0.25], [[(10, -2.0)], [(7, -0.25)]]),
    ]
    triton = FakeTriton(deltas)
    r = client(triton).post("/v1/completions", json={"model": "llm", "prompt": [PROMPT_IDS], "logprobs": 0})
    choice = r.json()["choices"][0]
    assert choice["text"] == " Parisé." and not triton.calls[0][1].prompt_log_probs
    assert choice["logprobs"]["tokens"] == [" Paris", "\ufffd", "\ufffd", "."]
    assert choice["logprobs"]["token_logprobs"] == [-0.5, -1.0, -2.0, -0.25]
    assert choice["logprobs"]["top_logprobs"][0] == {" Paris": -0.5}
    assert choice["logprobs"]["text_offset"] == [0, 6, 6, 7]  # each response starts where the text is
    plain = client(FakeTriton(deltas)).post("/v1/completions", json={"model": "llm", "prompt": "x"})
    assert plain.json()["choices"][0]["logprobs"] is None


def test_streamed_completion_carries_each_chunks_logprobs_and_the_prompt_first():
    deltas = [
        Delta(" Paris", 5, 1, None, [6], [-0.5], [[(6, -0.5)]], PROMPT_IDS, PROMPT_LPS, PROMPT_TOP),
        Delta("", 5, 2, None, [9], [-1.0], [[(9, -1.0)]]),
        Delta(".", 5, 3, "length", [7], [-0.25], [[(7, -0.25)]]),
    ]
    body = {"model": "llm", "prompt": "The capital of France is", "logprobs": 1, "echo": True, "stream": True}
    r = client(FakeTriton(deltas)).post("/v1/completions", json=body)
    assert r.status_code == 200
    chunks = events(r.text)
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["text"] == "The capital of France is"
    assert choices[0]["logprobs"]["token_logprobs"] == [None, *PROMPT_LPS]
    assert [c["logprobs"]["tokens"] for c in choices[1:4]] == [[" Paris"], ["\ufffd"], ["."]]
    assert [c["logprobs"]["text_offset"] for c in choices[1:4]] == [[24], [30], [30]]
    assert choices[-1]["finish_reason"] == "length" and choices[-1]["logprobs"] is None
    assert "".join(c["text"] for c in choices) == "The capital of France is Paris."


def test_a_token_id_prompt_for_generation_lm_eval_generate_until():
    triton = FakeTriton([Delta(" Paris", 5, 1, "stop", [6])])
    body = {"model": "llm", "prompt": [PROMPT_IDS], "max_tokens": 32, "stop": ["\n\n"], "temperature": 0, "seed": 1}
    r = client(triton).post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " Paris"
    prompt, params = triton.calls[0]
    assert prompt == PROMPT_IDS and params.stop == ["\n\n"] and not (params.log_probs or params.prompt_log_probs)
    # works without a tokenizer too: nothing to decode
    r = client(FakeTriton([Delta(" Paris", 5, 1, "stop", [6])]), tokenizer=None).post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " Paris"


def test_log_probabilities_that_do_not_fit_their_tokens_are_a_server_error():
    triton = FakeTriton([Delta(" Paris", 5, 1, "length", [6], None)])  # asked, not sent
    r = client(triton).post("/v1/completions", json={"model": "llm", "prompt": "x", "logprobs": 1})
    assert r.status_code == 500 and "log-probabilities" in r.json()["error"]["message"]


# ------------------------------------------------------------------ chat through the app


def test_chat_logprobs_whole_and_streamed():
    deltas = [
        Delta(" Paris", 9, 1, None, [6], [-0.5], [[(6, -0.5), (11, -2.0), (12, -3.0)]]),
        Delta(".", 9, 2, "stop", [7, 8], [-0.25, -0.125], [[(7, -0.25)] * 3, [(8, -0.125)] * 3]),
    ]
    messages = [{"role": "user", "content": "Capital of France?"}]
    body = {"model": "llm", "messages": messages, "logprobs": True, "top_logprobs": 2}
    triton = FakeTriton(deltas)
    r = client(triton).post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert triton.calls[0][1].log_probs and triton.calls[0][1].num_top_log_probs == 2
    logprobs = r.json()["choices"][0]["logprobs"]
    first = logprobs["content"][0]
    assert first == {
        "token": " Paris",
        "logprob": -0.5,
        "bytes": list(b" Paris"),
        "top_logprobs": [
            {"token": " Paris", "logprob": -0.5, "bytes": list(b" Paris")},
            {"token": " Lyon", "logprob": -2.0, "bytes": list(b" Lyon")},
        ],
    }
    assert [e["token"] for e in logprobs["content"]] == [" Paris", ".", "<|im_end|>"]
    streamed = events(client(FakeTriton(deltas)).post("/v1/chat/completions", json={**body, "stream": True}).text)
    per_chunk = [c["choices"][0]["logprobs"] for c in streamed]
    assert per_chunk[0] is None  # the role
    assert [e["token"] for e in per_chunk[1]["content"]] == [" Paris"]
    assert [e["token"] for e in per_chunk[2]["content"]] == [".", "<|im_end|>"]
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"
    # logprobs without top_logprobs: no top tokens; none asked: null
    triton = FakeTriton([Delta(" Paris", 9, 1, "stop", [6], [-0.5])])
    r = client(triton).post("/v1/chat/completions", json={"model": "llm", "messages": messages, "logprobs": True})
    assert r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    assert triton.calls[0][1].num_top_log_probs == 0
    r = client(FakeTriton(deltas)).post("/v1/chat/completions", json={"model": "llm", "messages": messages})
    assert r.json()["choices"][0]["logprobs"] is None


# ------------------------------------------------------------------ refused requests

CHAT = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
        ("/v1/completions", {"prompt": [[1, 2], [3]], "logprobs": 1, "echo": True}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logprobs": 1, "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "x", "echo": True, "n": 2}, "n"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": 3}, "logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "n": 2}, "n"),
    ],
)
def test_400_names_the_field(path, body, param):
    triton = FakeTriton([Delta("x", 1, 1, "length", [6])])
    r = client(triton).post(path, json={"model": "llm", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"], error
    assert triton.calls == []  # refused before Triton


@pytest.mark.parametrize("field", ["logprobs", "echo"])
def test_without_a_tokenizer_logprobs_and_echo_are_refused(field):
    triton = FakeTriton([Delta("x", 1, 1, "length", [6])])
    value = 1 if field == "logprobs" else True
    r = client(triton, tokenizer=None).post("/v1/completions", json={"model": "llm", "prompt": "x", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert "tokenizer" in r.json()["error"]["message"]


def test_a_triton_refusal_passes_through():
    bad = GenerationError(ErrorKind.BAD_REQUEST, "'input_ids' holds a token outside the vocabulary of 49152")
    r = client(FakeTriton(error=bad)).post("/v1/completions", json={"model": "llm", "prompt": [999999], "logprobs": 1})
    assert r.status_code == 400 and "input_ids" in r.json()["error"]["message"]


# ------------------------------------------------------------------ migration


SALT = "00"


def _record(name: str, keys: frozenset[int] = frozenset()) -> InstanceRecord:
    """Instance ``name``'s membership record, its cache summary holding ``keys``."""
    cache = json.dumps(CacheSummary(SALT, 4, 1, keys, 1000, 1000, 0, 0).to_json())
    return InstanceRecord("d", name, "decode", f"{name}:8001", "decode_0", "", "m", "l", 1, 0.0, False, cache=cache)


class MovingTriton:
    """Decode instances whose streams follow a plan: ``plan[name]`` output tokens, then the
    stream breaks (None: it finishes; 0: it sends one response with no token, then breaks). A
    request that asks for the prompt's log-probabilities gets them in its first response."""

    def __init__(self, plan: dict[str, int | None], max_tokens: int):
        self.plan, self.max_tokens = plan, max_tokens
        self.calls: list[tuple[str, list[int], bool]] = []  # (instance, resume_token_ids, prompt asked)

    def client_for(self, url: str):
        name, outer = url.partition(":")[0], self

        class Client:
            def generate(self, model, prompt, params, resume, traceparent=""):
                outer.calls.append((name, list(resume), params.prompt_log_probs))
                return outer._stream(name, params, len(resume))

        return Client()

    async def _stream(self, name: str, params: GenerationParams, start: int):
        n = self.plan[name]
        prompt = dict(prompt_token_ids=[1, 2, 3], prompt_log_probs=[-1.0, -2.0]) if params.prompt_log_probs else {}
        if n == 0:
            yield Delta("", 3, start, None, [], [], **prompt)  # type: ignore[arg-type]
        for i in range(start, self.max_tokens):
            if n is not None and i >= start + n:
                break
            last = i + 1 == self.max_tokens
            yield Delta(f"t{i}", 3, i + 1, "length" if last else None, [100 + i], [-float(i)], **prompt)  # type: ignore[arg-type]
            prompt = {}
            await asyncio.sleep(0)
        raise StreamLost(ErrorKind.OUT_OF_SERVICE, "connection lost")


@pytest.mark.parametrize("first_sends", [0, 2])
def test_a_moved_request_relays_the_prompt_logprobs_once_and_the_output_logprobs_go_on(first_sends):
    prompt = list(range(40))
    router = Router()
    keys = frozenset(page_key(h) for h in page_hashes(prompt, 4, bytes.fromhex(SALT)))
    router.watch.update([_record("a", keys), _record("b")], [])  # a holds the prompt: first pick
    router.watch.probed("a")
    router.watch.probed("b")
    fake = MovingTriton({"a": first_sends, "b": None}, max_tokens=5)
    fleet = DecodeFleet("etcd://unused:1", "d", b"", router)
    fleet._client = fake.client_for  # type: ignore[method-assign]
    params = GenerationParams(max_tokens=5, temperature=0.0, log_probs=True, prompt_log_probs=True)

    async def run() -> list[Delta]:
        return [d async for d in fleet.generate("req", prompt, params, prompt)]

    out = asyncio.run(run())
    assert [t for d in out for t in d.token_ids] == [100 + i for i in range(5)]
    assert [lp for d in out for lp in d.log_probs or []] == [-float(i) for i in range(5)]  # they go on
    with_prompt = [d for d in out if d.prompt_token_ids is not None]
    assert len(with_prompt) == 1 and with_prompt[0] is out[0] and out[0].prompt_log_probs == [-1.0, -2.0]
    if first_sends:  # b resumes after the tokens sent and is not asked for the prompt again
        assert fake.calls == [("a", [], True), ("b", [100, 101], False)]
    else:  # nothing sent but the prompt's: b is asked again (resumes nothing) and its copy is dropped
        assert fake.calls == [("a", [], True), ("b", [], True)]
        assert out[0].token_ids == [] and out[1].token_ids == [100] and out[1].prompt_log_probs is None
    assert router.migrations == {"stream_error": 1}
