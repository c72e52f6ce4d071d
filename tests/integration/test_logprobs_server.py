"""Log-probabilities through the Triton API on a real tritonserver, in both modes: the prompt's
(``return_prompt_log_probs``) and the output's (``return_log_probs``), with top-k, equal between
the disaggregated ``llm`` and ``llm_aggregated`` (float32, within 1e-4) and to transformers;
token-id prompts (``input_ids``), prompt scoring with max_tokens 0 (gRPC and HTTP), bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import requests

from backend.client import stream_generate
from tests.conftest import PROMPTS

TOP = 3


def hf_log_softmax(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1).numpy()


def ask(url, prompt, model, n=6, **kw):
    res = stream_generate(
        url, prompt, n, model=model, ignore_eos=True, log_probs=True, prompt_log_probs=True, top_log_probs=TOP, **kw
    )
    assert res.error is None, res.error
    return res


def test_log_probs_equal_across_modes_and_transformers(disagg_server, tokenizer, hf_model):
    url, prompt = disagg_server.grpc_url, PROMPTS[7]  # several prefill chunks at the 64-token budget
    disagg, agg = ask(url, prompt, "llm"), ask(url, prompt, "llm_aggregated")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert disagg.token_ids == agg.token_ids and len(disagg.token_ids) == 6
    for res in (disagg, agg):
        lp = res.log_probs
        assert lp["prompt_token_ids"] == ids
        assert len(lp["prompt_log_probs"]) == len(ids) - 1
        assert len(lp["prompt_top_log_probs"]) == len(lp["prompt_top_token_ids"]) == (len(ids) - 1) * TOP
        assert len(lp["output_log_probs"]) == 6 and len(lp["output_top_token_ids"]) == 6 * TOP
        assert math.isclose(lp["cum_log_probs"][0], sum(lp["output_log_probs"]), rel_tol=1e-5, abs_tol=1e-4)
        top_ids = np.array(lp["output_top_token_ids"]).reshape(6, TOP)
        assert top_ids[:, 0].tolist() == res.token_ids  # greedy: each output token is its top-1
        assert np.array(lp["output_top_log_probs"]).reshape(6, TOP)[:, 0].tolist() == lp["output_log_probs"]
    for name in ("prompt_log_probs", "prompt_top_log_probs", "output_log_probs", "output_top_log_probs"):
        np.testing.assert_allclose(disagg.log_probs[name], agg.log_probs[name], atol=1e-4, rtol=0, err_msg=name)
    assert disagg.log_probs["prompt_top_token_ids"] == agg.log_probs["prompt_top_token_ids"]

    tokens = ids + disagg.token_ids
    ref = hf_log_softmax(hf_model, tokens)
    positions = np.arange(len(tokens) - 1)
    want = ref[positions, np.array(tokens[1:])]
    got = np.array(disagg.log_probs["prompt_log_probs"] + disagg.log_probs["output_log_probs"])
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)


def test_output_log_probs_with_the_kv_from_a_prefill_instance(disagg_server):
    """Without prompt log-probabilities the prompt's KV comes from a prefill instance (the
    fixture sends every prefill across the fabric); the output's log-probabilities still equal
    the aggregated model's."""
    url, prompt = disagg_server.grpc_url, PROMPTS[6]
    kw = dict(model="llm", ignore_eos=True, log_probs=True, top_log_probs=2)
    disagg = stream_generate(url, prompt, 8, **kw)
    agg = stream_generate(url, prompt, 8, **{**kw, "model": "llm_aggregated"})
    assert disagg.error is None and agg.error is None
    assert disagg.token_ids == agg.token_ids
    assert "prompt_log_probs" not in disagg.log_probs
    np.testing.assert_allclose(disagg.log_probs["output_log_probs"], agg.log_probs["output_log_probs"], atol=1e-4)


def test_scoring_a_token_id_prompt_with_max_tokens_0(disagg_server, tokenizer, hf_model):
    ids = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    ref = hf_log_softmax(hf_model, ids)
    want = ref[np.arange(len(ids) - 1), np.array(ids[1:])]
    for model in ("llm", "llm_aggregated"):
        res = stream_generate(disagg_server.grpc_url, ids, 0, model=model, prompt_log_probs=True)
        assert res.error is None, res.error
        assert res.token_ids == [] and res.finish_reason == "length"
        assert res.log_probs["prompt_token_ids"] == ids
        np.testing.assert_allclose(res.log_probs["prompt_log_probs"], want, atol=1e-3)
    # the same through Triton's HTTP generate endpoint
    body = {"input_ids": ids, "max_tokens": 0, "return_prompt_log_probs": True}
    r = requests.post(f"http://{disagg_server.http_url}/v2/models/llm/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["prompt_log_probs"], want, atol=1e-3)


@pytest.mark.parametrize(
    "prompt, n, kw, words",
    [
        ("Hello", 4, dict(log_probs=True, top_log_probs=21), "num_top_log_probs"),
        ("Hello", 4, dict(log_probs=True, extra_draft=2), "num_draft_tokens"),
        ("Hello", 0, dict(log_probs=True), "max_tokens"),
        ([1, 2, 10**7], 4, dict(log_probs=True), "input_ids"),
        ([1, 2, 3], 4, dict(log_probs=True, chat=True), "apply_chat_template"),
    ],
)
def test_bad_log_prob_requests_are_refused_naming_the_input(disagg_server, prompt, n, kw, words):
    kw = dict(kw)
    if "extra_draft" in kw:
        kw["extra"] = {"num_draft_tokens": (np.array([kw.pop("extra_draft")], dtype=np.int32), "INT32")}
    for model in ("llm", "llm_aggregated"):
        res = stream_generate(disagg_server.grpc_url, prompt, n, model=model, **kw)
        assert res.error is not None and "[bad_request]" in res.error and words in res.error, res.error
