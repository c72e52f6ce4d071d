"""Request and response bodies of the OpenAI API as far as this frontend serves it (pydantic).

Accepted: ``model``, ``prompt`` or ``messages`` (text content), ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``, ``n`` = 1, ``response_format`` (``text``, ``json_object``,
``json_schema``), ``user`` (ignored), and vLLM's extensions ``ignore_eos`` and ``min_tokens``
(benchmarks ask for a fixed output length with them) and ``cache_salt`` (the request's
prefix-cache tenant: its KV is reused only by requests with the same salt).

Log-probabilities: a completion's ``prompt`` is a string, a list of one string, token ids or a
list of one list of token ids (what lm-eval sends); ``logprobs`` (0..5: the chosen tokens'
log-probabilities and the k most likely at each position) and ``echo`` (the prompt comes first
in the text, and with ``logprobs`` its tokens first in the log-probabilities; ``max_tokens`` 0
then only scores the prompt). A chat completion takes ``logprobs`` (bool) and
``top_logprobs`` (0..20, with ``logprobs`` only).

Fields this server cannot honour (``n`` > 1, ``best_of``, ``suffix``, penalties, ``logit_bias``,
``tools``, a chat's ``echo``, a completion's ``top_logprobs``) are refused with a 400 that names
them, never silently ignored; other unknown fields are ignored, as OpenAI's clients send fields
newer than any server.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

OPENAI_DEFAULT_TEMPERATURE = 1.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit of a completion's ``logprobs``
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limit of a chat's ``top_logprobs`` (the Triton API's too)


class UnsupportedField(ValueError):
    """A request field this server does not implement (HTTP 400, ``param`` names it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


Refusals = dict[str, tuple[str, tuple[object, ...]]]

# field -> (why it is refused, values that ask for nothing and are accepted)
_REFUSED: Refusals = {
    "best_of": ("best_of is not supported", (None, 1)),
    "suffix": ("suffix is not supported", (None, "")),
    "logit_bias": ("logit_bias is not supported", (None, {})),
    "tools": ("tools are not supported", (None, [])),
    "tool_choice": ("tools are not supported", (None, "none")),
    "functions": ("functions are not supported", (None, [])),
    "presence_penalty": ("presence_penalty is not supported (only 0)", (None, 0)),
    "frequency_penalty": ("frequency_penalty is not supported (only 0)", (None, 0)),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    name: str = "schema"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    response_format: ResponseFormat | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    user: str | None = None
    cache_salt: str | None = Field(default=None, max_length=256)

    _refused: ClassVar[Refusals] = _REFUSED  # this endpoint's refused fields

    def check_supported(self) -> None:
        """Raise :class:`UnsupportedField` for a field set to something this server cannot do."""
        if self.n != 1:
            raise UnsupportedField("n", f"n must be 1 (got {self.n}): one choice per request")
        extra = self.model_extra or {}
        for name, (message, harmless) in self._refused.items():
            if name in extra and extra[name] not in harmless:
                raise UnsupportedField(name, message)

    @field_validator("stop")
    @classmethod
    def _stop_words(cls, v):
        if isinstance(v, str):
            v = [v]
        if v is not None and any(not w for w in v):
            raise ValueError("stop words must be non-empty")
        return v

    def guided_json(self) -> str | None:
        """The JSON schema that constrains the output, as the ``guided_json`` tensor takes it."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return json.dumps({"type": "object"})
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise UnsupportedField("response_format", "response_format json_schema needs json_schema.schema")
        return json.dumps(fmt.json_schema.schema_)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    _refused: ClassVar[Refusals] = {
        **_REFUSED,
        "top_logprobs": ("top_logprobs is a chat completions field: a completion takes logprobs (0..5)", (None, 0)),
    }

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=COMPLETIONS_DEFAULT_MAX_TOKENS, ge=0)
    # strict: ``true`` (a chat's logprobs) is no count of top tokens
    logprobs: Annotated[int, Field(strict=True)] | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt_shape(cls, v):
        """Checked here, not by the union (whose errors would name its members, not ``prompt``)."""

        def ids(x) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str) or ids(v):
            return v
        if isinstance(v, list) and (all(isinstance(p, str) for p in v) or all(ids(p) for p in v)):
            return v
        raise ValueError("the prompt is a string, token ids (integers), or a list of one of them")

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedField(
                "max_tokens", "max_tokens must be at least 1 (0 only with echo: the request then scores its prompt)"
            )

    def output_limit(self) -> int:
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    def prompt_input(self) -> str | list[int]:
        """The one prompt: its text, or its token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if prompt and all(isinstance(p, int) for p in prompt):
            ids = [int(p) for p in prompt]  # type: ignore[arg-type]
        elif len(prompt) == 1:
            one = prompt[0]
            if isinstance(one, str):
                return one
            ids = list(one)  # type: ignore[arg-type]
        else:
            raise UnsupportedField(
                "prompt", f"one prompt per request (a string, token ids, or a list of one of them); got {len(prompt)}"
            )
        if not ids:
            raise UnsupportedField("prompt", "the prompt holds no token id")
        if any(t < 0 for t in ids):
            raise UnsupportedField("prompt", "a token id of the prompt is negative")
        return ids


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    _refused: ClassVar[Refusals] = {
        **_REFUSED,
        "echo": ("echo is not a chat completions field (completions take it)", (None, False)),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedField("top_logprobs", "top_logprobs needs logprobs: true")

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        """The messages as a chat template takes them (``developer`` is OpenAI's new ``system``)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
