"""Request and response bodies of the OpenAI API, as vLLM accepts them.

Requests are validated twice: shapes and types here (pydantic, strict as OpenAI's
types are: ``"max_tokens": "16"`` or ``"stream": "yes"`` is a 400), values by
``SamplingParams`` (the same rules as the offline API). Every string must be valid
Unicode (JSON can carry a lone surrogate such as ``"\ud800"``, which no tokenizer
can encode). Fields of the OpenAI API that this server does not implement are
refused with a 400 naming them, never silently ignored; unknown fields are ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams


def _check_unicode(value: Any) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("contains a lone surrogate: not valid Unicode text") from None
    elif isinstance(value, list):
        for v in value:
            _check_unicode(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k)
            _check_unicode(v)


class _Body(BaseModel):
    """Strict types, valid Unicode in every string, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_unicode(value)
        return value


class StreamOptions(_Body):
    include_usage: bool = False


# OpenAI fields this server does not implement: refused when set, not ignored.
# (tools and response_format come with structured output.)
_UNSUPPORTED = ("logit_bias", "suffix", "tools", "tool_choice", "functions", "function_call", "response_format",
                "parallel_tool_calls", "guided_json", "guided_regex", "guided_choice", "guided_grammar")  # fmt: skip


class _SamplingFields(_Body):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_timings: bool = False  # tokenmill extra: per-request timings in the last response
    best_of: int | None = None  # accepted only as n (no server-side ranking of extra samples)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in _UNSUPPORTED:
                if data.get(name) not in (None, {}, []):
                    raise ValueError(f"{name} is not supported by this server")
        return data

    @field_validator("best_of", mode="after")
    @classmethod
    def _best_of(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("best_of other than 1 is not supported (use n)")
        return value

    def _sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        def pick(value, default):
            return default if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, 0),
            min_p=pick(self.min_p, 0.0),
            seed=self.seed,
            stop=self.stop or (),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        return self._sampling(max_tokens, self.logprobs)


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError("only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        return self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


FinishReason = Literal["stop", "length", "abort", "error"] | None
