"""Unit tests of request parsing and repository rendering."""

import numpy as np
import pytest

from backend.serving.request import RequestError, parse_request


def getter(**tensors):
    return lambda name: tensors.get(name)


def test_parse_full_request():
    req = parse_request(
        getter(
            text_input=np.array([b"hi"], dtype=object),
            max_tokens=np.array([5], np.int32),
            stream=np.array([True]),
            temperature=np.array([0.5], np.float32),
            top_k=np.array([3], np.int32),
            random_seed=np.array([7], np.uint64),
            stop_words=np.array([b"\n", b""], dtype=object),
        ),
        max_tokens_limit=10,
    )
    assert (req.text, req.max_tokens, req.stream, req.temperature, req.top_k, req.seed) == ("hi", 5, True, 0.5, 3, 7)
    assert req.stop_words == ["\n"]


def test_tensorrt_llm_min_length_and_exclude_input():
    base = {"text_input": np.array([b"x"], dtype=object), "max_tokens": np.array([8], np.int32)}
    req = parse_request(
        getter(**base, min_length=np.array([8], np.int32), exclude_input_in_output=np.array([True])),
        max_tokens_limit=10,
    )
    assert req.min_length == 8
    with pytest.raises(RequestError, match="exclude_input_in_output"):
        parse_request(getter(**base, exclude_input_in_output=np.array([False])), max_tokens_limit=10)
    with pytest.raises(RequestError, match="min_tokens"):
        parse_request(getter(**base, min_length=np.array([9], np.int32)), max_tokens_limit=10)


def test_cache_salt_is_one_bounded_string():
    base = {"text_input": np.array([b"x"], dtype=object), "max_tokens": np.array([8], np.int32)}
    req = parse_request(getter(**base, cache_salt=np.array([b"tenant-a"], dtype=object)), max_tokens_limit=10)
    assert req.cache_salt == "tenant-a"
    assert parse_request(getter(**base), max_tokens_limit=10).cache_salt == ""
    with pytest.raises(RequestError, match="cache_salt must be a string of at most 256"):
        parse_request(getter(**base, cache_salt=np.array([b"s" * 300], dtype=object)), max_tokens_limit=10)
    with pytest.raises(RequestError, match="exactly one string"):
        parse_request(getter(**base, cache_salt=np.array([b"a", b"b"], dtype=object)), max_tokens_limit=10)


@pytest.mark.parametrize(
    "tensors,msg",
    [
        ({}, "'text_input' is required"),
        ({"text_input": np.array([b"  "], dtype=object), "max_tokens": np.array([3], np.int32)}, "empty"),
        ({"text_input": np.array([b"x"], dtype=object)}, "'max_tokens' is required"),
        ({"text_input": np.array([b"x"], dtype=object), "max_tokens": np.array([0], np.int32)}, "> 0"),
        (
            {"text_input": np.array([b"x"], dtype=object), "max_tokens": np.array([11], np.int32)},
            "exceeds the configured limit",
        ),
        ({"text_input": np.array([b"x"], dtype=object), "max_tokens": np.array([1.5], np.float32)}, "data type"),
        ({"text_input": np.array([1], np.int32), "max_tokens": np.array([1], np.int32)}, "data type"),
        (
            {
                "text_input": np.array([b"x"], dtype=object),
                "max_tokens": np.array([1], np.int32),
                "top_p": np.array([0.0], np.float32),
            },
            "top_p",
        ),
    ],
)
def test_parse_rejects(tensors, msg):
    with pytest.raises(RequestError, match=msg):
        parse_request(getter(**tensors), max_tokens_limit=10)


def test_log_prob_inputs_and_token_id_prompts():
    ids = np.array([5, 6, 7], np.int32)
    req = parse_request(
        getter(
            input_ids=ids,
            max_tokens=np.array([0], np.int32),
            return_prompt_log_probs=np.array([True]),
            return_log_probs=np.array([True]),
            num_top_log_probs=np.array([4], np.int32),
        ),
        max_tokens_limit=10,
    )
    assert (req.input_ids, req.score_only, req.return_log_probs, req.num_top_log_probs) == ([5, 6, 7], True, True, 4)


@pytest.mark.parametrize(
    "tensors, msg",
    [
        (dict(input_ids=np.array([1], np.int32), max_tokens=np.array([0], np.int32)), "return_prompt_log_probs"),
        (dict(input_ids=np.array([], np.int32), max_tokens=np.array([2], np.int32)), "'input_ids' is empty"),
        (dict(input_ids=np.array([-1], np.int32), max_tokens=np.array([2], np.int32)), "negative"),
        (
            dict(
                input_ids=np.array([1], np.int32), text_input=np.array([b"x"], dtype=object), max_tokens=np.array([2])
            ),
            "not both",
        ),
        (
            dict(input_ids=np.array([1], np.int32), max_tokens=np.array([2]), num_top_log_probs=np.array([21])),
            "num_top_log_probs",
        ),
        (
            dict(
                input_ids=np.array([1], np.int32),
                max_tokens=np.array([2]),
                return_log_probs=np.array([True]),
                num_draft_tokens=np.array([3], np.int32),
            ),
            "num_draft_tokens",
        ),
        (
            dict(input_ids=np.array([1], np.int32), max_tokens=np.array([2]), apply_chat_template=np.array([True])),
            "apply_chat_template",
        ),
    ],
)
def test_log_prob_inputs_refused(tensors, msg):
    with pytest.raises(RequestError, match=msg):
        parse_request(getter(**tensors), max_tokens_limit=10)
