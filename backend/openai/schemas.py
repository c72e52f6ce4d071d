"""Request and response bodies of the OpenAI API as far as this frontend serves it (pydantic).

Accepted: ``model``, ``prompt`` (text) or ``messages`` (text content), ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``, ``n`` = 1, ``response_format`` (``text``, ``json_object``,
``json_schema``), ``user`` (ignored), and vLLM's extensions ``ignore_eos`` and ``min_tokens``
(benchmarks ask for a fixed output length with them). Fields this server cannot honour (``n`` > 1, ``logprobs``,
``echo``, ``best_of``, ``suffix``, penalties, ``logit_bias``, ``tools``) are refused with a 400
that names them, never silently ignored; other unknown fields are ignored, as OpenAI's clients
send fields newer than any server.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

OPENAI_DEFAULT_TEMPERATURE = 1.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class UnsupportedField(ValueError):
    """A request field this server does not implement (HTTP 400, ``param`` names it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# field -> (why it is refused, values that ask for nothing and are accepted)
_REFUSED: dict[str, tuple[str, tuple[object, ...]]] = {
    "logprobs": ("logprobs are not supported", (None, False, 0)),
    "top_logprobs": ("logprobs are not supported", (None, 0)),
    "echo": ("echo is not supported", (None, False)),
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

    def check_supported(self) -> None:
        """Raise :class:`UnsupportedField` for a field set to something this server cannot do."""
        if self.n != 1:
            raise UnsupportedField("n", f"n must be 1 (got {self.n}): one choice per request")
        extra = self.model_extra or {}
        for name, (message, harmless) in _REFUSED.items():
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
    prompt: str | list[str]
    max_tokens: int | None = Field(default=COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)

    def prompt_text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise UnsupportedField("prompt", "one prompt per request (a list of one string at most)")
            return self.prompt[0]
        return self.prompt


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
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

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
