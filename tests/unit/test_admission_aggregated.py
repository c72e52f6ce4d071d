"""Admission in front of a worker (``backend/serving/admission.py``) with the aggregated worker
(``aggregated_worker.py``, picked by ``roles.make_worker``) on a tiny random model: a request
streams to the end, bad input is refused with its kind, the in-flight bound answers overloaded,
a cancel by external id stops a stream, and a drain ends what is in flight and refuses the rest.
The same paths run end to end against a real tritonserver in ``tests/integration``."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from engine_helpers import build_tiny_llama

from backend.engine.outputs import ErrorKind
from backend.serving.admission import Admission
from backend.serving.config import InstanceConfig
from backend.serving.roles import make_worker


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_admission"))


class CharTokenizer:
    """One token per character, inside the tiny model's vocabulary."""

    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + ord(c) % 250 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


class Sink:
    def __init__(self):
        self.tokens: list[int] = []
        self.text = ""
        self.failed: tuple[str, ErrorKind] | None = None
        self.done = threading.Event()
        self.cancelled = False

    def send(self, text, token_ids, n_input, n_output, finish_reason, final, extras=None) -> None:
        self.tokens += token_ids
        self.text += text
        if final:
            self.done.set()

    def error(self, message, kind) -> None:
        self.failed = (message, kind)
        self.done.set()

    def close(self) -> None:
        self.done.set()

    def is_cancelled(self) -> bool:
        return self.cancelled


class CountingSink(Sink):
    def __init__(self):
        super().__init__()
        self.counts: list[tuple[int, int]] = []  # (num_input_tokens, num_output_tokens) of each response

    def send(self, text, token_ids, n_input, n_output, finish_reason, final, extras=None) -> None:
        self.counts.append((n_input, n_output))
        super().send(text, token_ids, n_input, n_output, finish_reason, final)


def getter(**inputs):
    arrays = {
        k: v
        if isinstance(v, list)
        else np.array([v.encode()] if isinstance(v, str) else [v], dtype=object if isinstance(v, str) else None)
        for k, v in inputs.items()
    }
    arrays = {k: np.array(v, dtype=np.int32) if isinstance(v, list) else v for k, v in arrays.items()}
    return lambda name: arrays.get(name)


@pytest.fixture
def admission(tiny_dir):
    config = InstanceConfig.from_parameters(
        {"role": "aggregated", "model_path": str(tiny_dir), "kv_cache_tokens": "1024", "max_queue_size": "2"}
    )
    worker = make_worker(config, "unit-agg")
    done = []
    adm = Admission(config, worker, CharTokenizer(), "unit-agg", on_done=lambda s, reason: done.append(reason))
    adm.done_reasons = done  # type: ignore[attr-defined]
    yield adm
    adm.close()
    worker.shutdown()


def test_a_request_streams_to_its_end(admission):
    sink = Sink()
    admission.admit(getter(text_input="hello there", max_tokens=np.int32(6), stream=True, ignore_eos=True), sink)
    assert sink.done.wait(20) and sink.failed is None and len(sink.tokens) == 6
    assert admission.active() == 0 and admission.done_reasons == ["length"]
    stats = admission.worker.stats()
    assert stats.kv_pages_free == stats.kv_pages_total and admission.worker.health() is None
    assert "KV pool" in admission.worker.describe() and admission.worker.cache_summary().page_size > 0


@pytest.mark.parametrize(
    "inputs,message",
    [
        ({"max_tokens": np.int32(4)}, "'text_input' is required"),
        ({"text_input": "hi"}, "'max_tokens' is required"),
        ({"text_input": "hi", "max_tokens": np.int32(0)}, "must be > 0"),
        ({"text_input": "hi", "max_tokens": np.int32(4), "top_p": np.float32(2.0)}, "top_p"),
        ({"text_input": "x" * 600, "max_tokens": np.int32(4)}, "exceeds the model context"),
        ({"text_input": "hi", "max_tokens": np.int32(2), "resume_token_ids": [5, 6, 7]}, "more than max_tokens 2"),
        ({"text_input": "hi", "max_tokens": np.int32(4), "resume_token_ids": [-1]}, "negative token id"),
        ({"text_input": "hi", "max_tokens": np.int32(4), "resume_token_ids": [1 << 20]}, "outside the vocabulary"),
    ],
)
def test_bad_input_is_refused_with_its_kind(admission, inputs, message):
    sink = Sink()
    admission.admit(getter(**inputs), sink)
    assert sink.done.wait(5) and sink.failed is not None, inputs
    assert message in sink.failed[0] and sink.failed[1] is ErrorKind.BAD_REQUEST, sink.failed


def test_in_flight_bound_cancel_and_drain(admission):
    long = dict(text_input="a long story", max_tokens=np.int32(200), stream=True, ignore_eos=True)
    first, second, third = Sink(), Sink(), Sink()
    admission.admit(getter(**long), first, "ext-1")
    admission.admit(getter(**long), second, "ext-2")
    admission.admit(getter(**long), third)  # max_queue_size 2
    assert third.done.wait(5) and third.failed is not None and third.failed[1] is ErrorKind.OVERLOADED
    admission.cancel_by_external_id("ext-1")
    assert first.done.wait(20) and first.failed is None and len(first.tokens) < 200
    assert admission.drain("the server is stopping") == 1
    assert second.done.wait(20) and second.failed is not None and second.failed[1] is ErrorKind.OUT_OF_SERVICE
    late = Sink()
    admission.admit(getter(text_input="hi", max_tokens=np.int32(2)), late)
    assert late.done.wait(5) and late.failed is not None and late.failed[1] is ErrorKind.OUT_OF_SERVICE
    with pytest.raises(ValueError, match="no client-facing worker"):
        make_worker(InstanceConfig.from_parameters({"role": "prefill", "model_path": "x"}), "p")


def test_a_resumed_request_continues_where_the_output_stopped(admission):
    """Request migration's decode side: given the output a client already has
    (``resume_token_ids``), the request sends exactly what an uninterrupted run sends after it,
    counting the whole output."""
    whole = Sink()
    admission.admit(getter(text_input="resume me", max_tokens=np.int32(12), stream=True, ignore_eos=True), whole)
    assert whole.done.wait(20) and whole.failed is None and len(whole.tokens) == 12
    for k in (1, 5, 11):
        rest = CountingSink()
        inputs = getter(
            text_input="resume me",
            max_tokens=np.int32(12),
            stream=True,
            ignore_eos=True,
            resume_token_ids=whole.tokens[:k],
        )
        admission.admit(inputs, rest)
        assert rest.done.wait(20) and rest.failed is None
        assert rest.tokens == whole.tokens[k:]
        assert rest.counts[-1] == (len("resume me"), 12)  # the client's prompt; the whole output
        assert whole.text == CharTokenizer().decode(whole.tokens[:k]) + rest.text


def test_a_resumed_output_that_is_complete_ends_at_once_with_no_new_token(admission):
    """A move after the instance had ended the request but before its last response reached the
    router: the client has the end token (or all max_tokens tokens) already; the request ends at
    once (its final response, the whole output counted), never generates past its end."""
    whole = Sink()
    admission.admit(getter(text_input="resume me", max_tokens=np.int32(6), stream=True, ignore_eos=True), whole)
    assert whole.done.wait(20) and whole.failed is None and len(whole.tokens) == 6
    eos = admission.worker.end_ids[0]
    cases = [
        (dict(max_tokens=np.int32(6), ignore_eos=True), whole.tokens, "length"),
        (dict(max_tokens=np.int32(20)), whole.tokens[:3] + [eos], "stop"),
        (dict(max_tokens=np.int32(20), end_id=np.int32(whole.tokens[2])), whole.tokens[:3], "stop"),
    ]
    for extra, sent, reason in cases:
        rest = FinishSink()
        admission.admit(getter(text_input="resume me", stream=True, resume_token_ids=sent, **extra), rest)
        assert rest.done.wait(20) and rest.failed is None, rest.failed
        assert rest.tokens == [] and rest.finish == [reason], (extra, rest.finish)
        assert rest.counts[-1] == (len("resume me"), len(sent))
    # an end token the client asked to ignore is output like any other: the request goes on
    rest = FinishSink()
    admission.admit(
        getter(
            text_input="resume me",
            max_tokens=np.int32(6),
            stream=True,
            ignore_eos=True,
            resume_token_ids=whole.tokens[:2] + [eos],
        ),
        rest,
    )
    assert rest.done.wait(20) and rest.failed is None and len(rest.tokens) == 3


class FinishSink(CountingSink):
    def __init__(self):
        super().__init__()
        self.finish: list[str] = []

    def send(self, text, token_ids, n_input, n_output, finish_reason, final, extras=None) -> None:
        if final:
            self.finish.append(finish_reason)
        super().send(text, token_ids, n_input, n_output, finish_reason, final, extras)


class ExtrasSink(Sink):
    def __init__(self):
        super().__init__()
        self.extras: list[dict] = []

    def send(self, text, token_ids, n_input, n_output, finish_reason, final, extras=None) -> None:
        self.extras.append(dict(extras or {}))
        super().send(text, token_ids, n_input, n_output, finish_reason, final)


def test_a_request_that_asks_for_its_figures_gets_them_in_its_last_response(admission):
    import json

    sink = ExtrasSink()
    inputs = dict(text_input="hello", max_tokens=np.int32(5), stream=True, ignore_eos=True)
    admission.admit(getter(**inputs, return_perf_metrics=True), sink)
    assert sink.done.wait(20) and sink.failed is None
    assert all("perf_metrics" not in e for e in sink.extras[:-1])  # only the last response
    figures = json.loads(sink.extras[-1]["perf_metrics"][0])
    assert figures["prompt_tokens"] == 5 and figures["output_tokens"] == 5
    assert 0 < figures["ttft_s"] <= figures["e2e_s"] and "kv_bytes" not in figures  # aggregated: no transfer
    plain = ExtrasSink()
    admission.admit(getter(**inputs), plain)
    assert plain.done.wait(20) and all("perf_metrics" not in e for e in plain.extras)  # not asked: none
