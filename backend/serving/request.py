"""Parse and validate one client request's tensors (TensorRT-LLM backend names).

Pure Python over numpy arrays, so it is unit-testable without a server: ``parse_request``
takes a ``get(name) -> np.ndarray | None`` accessor and returns a ``ClientRequest`` or raises
``RequestError`` with a message meant for the client.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from backend.engine.outputs import ErrorKind, FinishReason
from backend.engine.sampling_params import DRAFT_METHODS, MAX_TOP_LOGPROBS, SamplingParams
from backend.serving.tensors import INPUTS_BY_NAME

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar


class RequestError(ValueError):
    """A request refused at admission; the message is returned to the client with its kind
    (bad input unless said otherwise, e.g. overloaded)."""

    def __init__(self, message: str, kind: ErrorKind = ErrorKind.BAD_REQUEST):
        super().__init__(message)
        self.kind = kind


@dataclass
class ClientRequest:
    text: str
    max_tokens: int
    stream: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None
    stop_words: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_length: int = 0  # no end token before this many output tokens (TensorRT-LLM's name)
    apply_chat_template: bool = False
    num_draft_tokens: int | None = None  # None: the model's default (parameter speculative_k)
    draft_method: str | None = None  # None: the model's default (parameter draft_method)
    guided_json: str | None = None
    guided_regex: str | None = None
    grammar: CompiledGrammar | None = None  # compiled from guided_json / guided_regex at admission
    resume_ids: list[int] = field(default_factory=list)  # output the client has already (migration)
    input_ids: list[int] | None = None  # the prompt as token ids (instead of ``text``)
    return_log_probs: bool = False
    return_prompt_log_probs: bool = False
    num_top_log_probs: int = 0
    cache_salt: str = ""
    return_perf_metrics: bool = False  # its figures in its last response (``perf_metrics.py``)

    @property
    def remaining_tokens(self) -> int:
        """Output tokens still to generate here (``max_tokens`` less the resumed ones)."""
        return self.max_tokens - len(self.resume_ids)

    def resumed_end(self, model_end_ids: tuple[int, ...]) -> str | None:
        """Why a moved request's output, as its client has it already, is complete (its end
        token was sent, or all its tokens; the instance it was on ended it, but its last response
        did not reach the router before the move), or None: it goes on here."""
        if not self.resume_ids:
            return None
        if self.remaining_tokens <= 0:
            return FinishReason.LENGTH
        end_ids = (self.end_id,) if self.end_id is not None else model_end_ids
        if not self.ignore_eos and self.resume_ids[-1] in end_ids and len(self.resume_ids) >= self.min_length:
            return FinishReason.STOP
        return None

    @property
    def score_only(self) -> bool:
        """max_tokens 0: the request only scores its prompt (its prompt's log-probabilities)."""
        return self.max_tokens == 0


Getter = Callable[[str], np.ndarray | None]

MAX_STOP_WORDS = 32
MAX_STOP_WORD_BYTES = 1024


def _as_str(v) -> str:
    if isinstance(v, (bytes, np.bytes_)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"text is not valid UTF-8: {e}") from None
    if isinstance(v, str):
        return v
    raise RequestError(f"expected a string (BYTES tensor), got {type(v).__name__}")


def _scalar(get: Getter, name: str):
    arr = get(name)
    if arr is None:
        return None
    spec = INPUTS_BY_NAME[name]
    kinds, typ = spec.numpy_kinds, spec.py_type
    arr = np.asarray(arr)
    if arr.dtype.kind not in kinds:
        raise RequestError(f"input '{name}' has data type {arr.dtype}, expected {typ.__name__}")
    if arr.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one value per request, got {arr.size}")
    return typ(arr.reshape(-1)[0])


def _strings(get: Getter, name: str) -> list[str] | None:
    arr = get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.dtype.kind not in INPUTS_BY_NAME[name].numpy_kinds:
        raise RequestError(f"input '{name}' has data type {arr.dtype}, expected BYTES (string)")
    return [_as_str(v) for v in arr.reshape(-1)]


def parse_request(get: Getter, *, max_tokens_limit: int, max_input_bytes: int = 1 << 20) -> ClientRequest:
    """Every input checked here, before a session exists: types, one value each, numbers
    finite and in range, strings within their limits (``max_input_bytes`` for the prompt,
    :data:`MAX_STOP_WORDS` of at most :data:`MAX_STOP_WORD_BYTES` each)."""
    raw = get("text_input")
    if raw is not None and np.asarray(raw).dtype.kind in "OSU":
        size = sum(len(v) if isinstance(v, (bytes, str)) else 0 for v in np.asarray(raw).reshape(-1))
        if size > max_input_bytes:  # before decoding or tokenizing it
            raise RequestError(f"'text_input' has {size} bytes; the limit is {max_input_bytes} (max_input_bytes)")
    texts = _strings(get, "text_input")
    input_ids = _token_ids(get, "input_ids")
    if texts is not None and input_ids is not None:
        raise RequestError("give one of 'text_input' and 'input_ids', not both")
    text = ""
    if input_ids is not None:
        if not input_ids:
            raise RequestError("input 'input_ids' is empty")
    else:
        if not texts:
            raise RequestError("input 'text_input' is required (or 'input_ids': the prompt as token ids)")
        if len(texts) != 1:
            raise RequestError(f"one prompt per request is supported, got {len(texts)} in 'text_input'")
        text = texts[0]
        if not text.strip():
            raise RequestError("input 'text_input' is empty")
    max_tokens = _scalar(get, "max_tokens")
    if max_tokens is None:
        raise RequestError("input 'max_tokens' is required")
    scoring = bool(_scalar(get, "return_prompt_log_probs"))
    if max_tokens < 0 or (max_tokens == 0 and not scoring):
        raise RequestError(
            f"'max_tokens' must be > 0 (0 only with 'return_prompt_log_probs' true: scoring the prompt), "
            f"got {max_tokens}"
        )
    if max_tokens > max_tokens_limit:
        raise RequestError(f"'max_tokens' {max_tokens} exceeds the configured limit {max_tokens_limit}")
    req = ClientRequest(text=text, max_tokens=max_tokens, input_ids=input_ids, return_prompt_log_probs=scoring)
    for name, attr in (
        ("stream", "stream"),
        ("temperature", "temperature"),
        ("top_k", "top_k"),
        ("top_p", "top_p"),
        ("random_seed", "seed"),
        ("end_id", "end_id"),
        ("ignore_eos", "ignore_eos"),
        ("min_length", "min_length"),
        ("apply_chat_template", "apply_chat_template"),
        ("return_log_probs", "return_log_probs"),
        ("num_top_log_probs", "num_top_log_probs"),
        ("return_perf_metrics", "return_perf_metrics"),
    ):
        v = _scalar(get, name)
        if v is not None:
            setattr(req, attr, v)
    if _scalar(get, "exclude_input_in_output") is False:  # TensorRT-LLM's echo switch; true is all we do
        raise RequestError("'exclude_input_in_output' false is not supported: the output never repeats the input")
    stops = _strings(get, "stop_words")
    if stops:
        if len(stops) > MAX_STOP_WORDS:
            raise RequestError(f"'stop_words' has {len(stops)} entries; the limit is {MAX_STOP_WORDS}")
        if any(len(s.encode()) > MAX_STOP_WORD_BYTES for s in stops):
            raise RequestError(f"a stop word is longer than {MAX_STOP_WORD_BYTES} bytes")
        req.stop_words = [s for s in stops if s]
    if req.input_ids is not None and req.apply_chat_template:
        raise RequestError(
            "'apply_chat_template' applies to 'text_input', not to 'input_ids' (token ids are sent as is)"
        )
    _parse_decode_options(get, req)
    _parse_resume(get, req)
    _check_logprobs(req)
    _check_sampling(req)
    return req


def _token_ids(get: Getter, name: str) -> list[int] | None:
    arr = get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.size and arr.dtype.kind not in INPUTS_BY_NAME[name].numpy_kinds:
        raise RequestError(f"input '{name}' has data type {arr.dtype}, expected int32")
    ids = [int(v) for v in arr.reshape(-1)]
    if any(v < 0 for v in ids):
        raise RequestError(f"'{name}' holds a negative token id")
    return ids


def _check_logprobs(req: ClientRequest) -> None:
    """Log-probabilities: k in range, and never with what cannot give them."""
    wanted = req.return_log_probs or req.return_prompt_log_probs
    if not 0 <= req.num_top_log_probs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"'num_top_log_probs' must be in [0, {MAX_TOP_LOGPROBS}], got {req.num_top_log_probs}")
    if wanted and req.num_draft_tokens:
        raise RequestError(
            "'return_log_probs' / 'return_prompt_log_probs' cannot be combined with 'num_draft_tokens' > 0: "
            "speculative decoding gives no log-probabilities"
        )


def _parse_resume(get: Getter, req: ClientRequest) -> None:
    arr = get("resume_token_ids")
    if arr is None:
        return
    arr = np.asarray(arr)
    if arr.size and arr.dtype.kind not in INPUTS_BY_NAME["resume_token_ids"].numpy_kinds:
        raise RequestError(f"input 'resume_token_ids' has data type {arr.dtype}, expected int32")
    ids = [int(v) for v in arr.reshape(-1)]
    if any(v < 0 for v in ids):
        raise RequestError("'resume_token_ids' holds a negative token id")
    if len(ids) > req.max_tokens:  # as many: the output is complete (``resumed_end``)
        raise RequestError(f"'resume_token_ids' has {len(ids)} tokens, more than max_tokens {req.max_tokens}")
    req.resume_ids = ids


def prompt_token_ids(tokenizer, text: str, apply_chat_template: bool) -> list[int]:
    """The prompt's token ids: the text as one user turn in the model's chat template, or as is.
    (The front model tokenizes the same way to route by the KV each instance holds.)"""
    if apply_chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
    return tokenizer.encode(text, add_special_tokens=False)


def _check_sampling(req: ClientRequest) -> None:
    """The sampling values are checked by the one definition of them (``SamplingParams``), here
    at admission, so a bad value (a negative or NaN temperature, ...) never reaches a worker."""
    try:
        SamplingParams(
            max_tokens=max(1, req.max_tokens),  # a scoring request (0) runs one step
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            min_tokens=req.min_length,
            num_draft_tokens=req.num_draft_tokens or 0,
            draft_method=req.draft_method or DRAFT_METHODS[0],
            cache_salt=req.cache_salt,
        )
    except ValueError as e:
        raise RequestError(str(e)) from None


def _parse_decode_options(get: Getter, req: ClientRequest) -> None:
    """Speculative decoding and structured-output inputs (grammars compile later)."""
    req.num_draft_tokens = _scalar(get, "num_draft_tokens")
    for name in ("draft_method", "guided_json", "guided_regex", "cache_salt"):
        values = _strings(get, name)
        if values is not None:
            if len(values) != 1:
                raise RequestError(f"input '{name}' must hold exactly one string, got {len(values)}")
            setattr(req, name, values[0])
    if req.guided_json is not None and req.guided_regex is not None:
        raise RequestError("give at most one of 'guided_json' and 'guided_regex'")
    for name in ("guided_json", "guided_regex"):
        if getattr(req, name) is not None and not getattr(req, name).strip():
            raise RequestError(f"input '{name}' is empty")
