"""The client-facing tensors (the names of NVIDIA's TensorRT-LLM backend): one definition from
which requests are parsed (``backend/serving/request.py``) and every model's ``config.pbtxt``
input and output lists are rendered (``build_scripts/render_repository.py``)."""

from __future__ import annotations

from dataclasses import dataclass

# Triton data type -> (numpy dtype kinds accepted, Python type of one value)
_KINDS = {
    "TYPE_STRING": ("OSU", str),
    "TYPE_INT32": ("iu", int),
    "TYPE_UINT64": ("iu", int),
    "TYPE_FP32": ("f", float),
    "TYPE_BOOL": ("b", bool),
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str
    optional: bool = True
    dims: str = "-1"

    @property
    def numpy_kinds(self) -> str:
        return _KINDS[self.data_type][0]

    @property
    def py_type(self) -> type:
        return _KINDS[self.data_type][1]

    def pbtxt(self, force_optional: bool = False) -> str:
        opt = ", optional: true" if self.optional or force_optional else ""
        return f'  {{ name: "{self.name}", data_type: {self.data_type}, dims: [ {self.dims} ]{opt} }}'


INPUTS = (
    TensorSpec("text_input", "TYPE_STRING"),  # the prompt as text, or:
    TensorSpec("input_ids", "TYPE_INT32"),  # the prompt as token ids (exactly one of the two)
    TensorSpec("max_tokens", "TYPE_INT32", optional=False),
    TensorSpec("stream", "TYPE_BOOL"),
    TensorSpec("temperature", "TYPE_FP32"),
    TensorSpec("top_k", "TYPE_INT32"),
    TensorSpec("top_p", "TYPE_FP32"),
    TensorSpec("random_seed", "TYPE_UINT64"),
    TensorSpec("end_id", "TYPE_INT32"),
    TensorSpec("stop_words", "TYPE_STRING"),
    TensorSpec("ignore_eos", "TYPE_BOOL"),
    TensorSpec("min_length", "TYPE_INT32"),
    TensorSpec("exclude_input_in_output", "TYPE_BOOL"),
    TensorSpec("apply_chat_template", "TYPE_BOOL"),
    TensorSpec("num_draft_tokens", "TYPE_INT32"),
    TensorSpec("draft_method", "TYPE_STRING"),
    TensorSpec("guided_json", "TYPE_STRING"),
    TensorSpec("guided_regex", "TYPE_STRING"),
    # The request's prefix-cache tenant: its KV is reused only by requests with the same salt
    # (TensorRT-LLM's and vLLM's name), in every tier and on every instance; empty: shared.
    TensorSpec("cache_salt", "TYPE_STRING"),
    # A request that continues elsewhere (request migration): the output tokens its client has
    # already received; they follow the prompt and count toward max_tokens and min_length, the
    # grammar replays them, and only what comes after them is sent.
    TensorSpec("resume_token_ids", "TYPE_INT32"),
    # Log-probabilities (log_softmax of the model's raw logits, float32): of each output token
    # (TensorRT-LLM's name), of the prompt's tokens 2..P (ours), and with num_top_log_probs k > 0
    # the k most likely tokens at each of those positions. max_tokens 0 is allowed with
    # return_prompt_log_probs: the request only scores its prompt.
    TensorSpec("return_log_probs", "TYPE_BOOL"),
    TensorSpec("return_prompt_log_probs", "TYPE_BOOL"),
    TensorSpec("num_top_log_probs", "TYPE_INT32"),
    # The request's own figures in its last response (``perf_metrics``; TensorRT-LLM's backend has
    # ``return_perf_metrics``): where its time went, its KV transfer, its moves.
    TensorSpec("return_perf_metrics", "TYPE_BOOL"),
)
# Sent by a front model that reaches a decode model by BLS (whose calls cannot be cancelled):
# cancel the request with this Triton request id. (Health, draining and cache summaries travel in
# the instance's membership record, readiness is Triton's own, and ``triton-disagg drain``
# reaches an instance through etcd: ``backend/serving/drain.py``.)
CANCEL_INPUT = TensorSpec("cancel_request_id", "TYPE_STRING")
CONTROL_INPUTS = (CANCEL_INPUT,)

OUTPUTS = (
    TensorSpec("text_output", "TYPE_STRING", optional=False),
    TensorSpec("output_token_ids", "TYPE_INT32", optional=False),
    TensorSpec("num_input_tokens", "TYPE_INT32", optional=False, dims="1"),
    TensorSpec("num_output_tokens", "TYPE_INT32", optional=False, dims="1"),
    TensorSpec("finish_reason", "TYPE_STRING", optional=False, dims="1"),
    # Only in responses to requests that asked for them (return_log_probs / return_prompt_log_probs):
    TensorSpec("output_log_probs", "TYPE_FP32", optional=False),  # [n]: this response's output tokens
    TensorSpec("cum_log_probs", "TYPE_FP32", optional=False, dims="1"),  # sum over the output so far
    TensorSpec("output_top_log_probs", "TYPE_FP32", optional=False),  # [n * k], row-major
    TensorSpec("output_top_token_ids", "TYPE_INT32", optional=False),  # [n * k], most likely first
    TensorSpec("prompt_token_ids", "TYPE_INT32", optional=False),  # [P], in the first response
    TensorSpec("prompt_log_probs", "TYPE_FP32", optional=False),  # [P - 1]: prompt tokens 2..P
    TensorSpec("prompt_top_log_probs", "TYPE_FP32", optional=False),  # [(P - 1) * k]
    TensorSpec("prompt_top_token_ids", "TYPE_INT32", optional=False),  # [(P - 1) * k]
    # Only in the last response of a request that asked (return_perf_metrics): a JSON object of
    # its figures (``backend/serving/perf_metrics.py``)
    TensorSpec("perf_metrics", "TYPE_STRING", optional=False, dims="1"),
)
PERF_OUTPUT = "perf_metrics"
LOGPROB_OUTPUTS = tuple(t.name for t in OUTPUTS[5:] if t.name != PERF_OUTPUT)

INPUTS_BY_NAME = {t.name: t for t in INPUTS + CONTROL_INPUTS}


def pbtxt_list(specs, force_optional: bool = False) -> str:
    """The body of a config.pbtxt ``input [...]`` / ``output [...]`` list."""
    return ",\n".join(s.pbtxt(force_optional) for s in specs)
