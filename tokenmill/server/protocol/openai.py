"""Request and response bodies of the OpenAI API, as vLLM accepts them.

Requests are validated twice: shapes and types here (pydantic, strict as OpenAI's
types are: ``"stream": "yes"`` is a 400; a number written as a string, ``"max_tokens":
"16"``, is taken as vLLM's validation takes it, the one exception), values by
``SamplingParams`` (the same rules as the offline API). Every string must be valid
Unicode (JSON can carry a lone surrogate such as ``"\ud800"``, which no tokenizer
can encode). A request field is never silently ignored: one this server does not
know is a 400 naming it, as OpenAI's ``Unrecognized request argument supplied``;
the few OpenAI fields accepted with no effect here are ``NO_EFFECT``, with why.
"""

from __future__ import annotations

import math
import re
import time
import types
import typing
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tokenmill.beam_search import BeamSearchParams
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import MAX_N, SamplingParams
from tokenmill.server.protocol.constraints import structured_outputs
from tokenmill.server.protocol.vllm_fields import AnswerExtras, ChatExtras, CompletionExtras, GenerationExtras
from tokenmill.structured.constraint import StructuredOutputs

MAX_DEPTH = 64  # JSON nested deeper than this in a field is refused (a schema 129 deep was a 500: issue 40)


def _check_unicode(value: Any, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("contains a lone surrogate: not valid Unicode text") from None
    elif isinstance(value, list):
        for v in value:
            _check_unicode(v, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k, depth + 1)
            _check_unicode(v, depth + 1)


_INT_TEXT = re.compile(r"\s*[+-]?\d{1,30}\s*")


def _number_from_text(value: str, annotation: Any) -> Any:
    """A number field's value sent as a string (``"16"``, ``"0.7"``) as the number, as vLLM's
    lax validation takes it; any other string is left for the strict check to refuse."""
    kinds = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if str in kinds:
        return value  # a string is a valid value of this field as it is
    if int in kinds and _INT_TEXT.fullmatch(value):
        return int(value)
    if float in kinds:
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    return value


class _Body(BaseModel):
    """Strict types, valid Unicode in every string, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _numbers_sent_as_text(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(isinstance(v, str) for v in data.values()):
            fields = cls.model_fields
            data = {
                k: _number_from_text(v, fields[k].annotation) if isinstance(v, str) and k in fields else v
                for k, v in data.items()
            }
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_unicode(value)
        return value


def client_request_id(header: str | None, body_id: str | None) -> str | None:
    """The id a client gave its request, as vLLM takes it: the X-Request-Id header, else the body's request_id."""
    return check_request_id(header, "X-Request-Id") if header is not None else body_id


# OpenAI fields accepted and then unused, and why: they ask nothing of the output.
NO_EFFECT = {
    "user": "an end-user id for OpenAI's abuse monitoring; nothing here reads it",
    "safety_identifier": "the same, newer name",
    "metadata": "tags for OpenAI's dashboard (echoed by /v1/responses)",
    "store": "on chat: OpenAI's stored completions; not kept here (/v1/responses does keep them)",
    "service_tier": "there is one tier here",
    "prompt_cache_key": "prefix caching here is automatic, by content",
}


class StrictBody(_Body):
    """A request body: a field it does not declare is refused by name, not ignored."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in data:
                if name not in cls.model_fields:
                    raise InvalidRequestError(f"Unrecognized request argument supplied: {name}", param=name)
        return data


class StreamOptions(StrictBody):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (guidellm always asks for it)
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding against length side channels: none is sent here


# OpenAI fields this server does not implement: refused when set, not ignored.
_UNSUPPORTED = ("suffix", "functions", "function_call")
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's older names
GUIDED_BACKENDS = ("auto", "guidance", "llguidance")  # what guided_decoding_backend may name here
MAX_REQUEST_ID = 256  # characters of a client's request id (X-Request-Id or request_id)


def valid_request_id(value: str) -> bool:
    """A client's request id that may appear in ids, logs, the live view and the response's
    X-Request-Id header: 1 to MAX_REQUEST_ID printable ASCII characters without spaces."""
    return 0 < len(value) <= MAX_REQUEST_ID and all(" " < ch < "\x7f" for ch in value)


def check_request_id(value: str, param: str) -> str:
    """A client's request id, as it will appear in ids, logs and the live view: printable ASCII, not too long
    (the 400 names the rule, not the value: it may be long, or hold what a log or a header should not)."""
    if not valid_request_id(value):
        raise InvalidRequestError(
            f"{param} must be 1 to {MAX_REQUEST_ID} printable ASCII characters without spaces", param=param
        )
    return value


class _SamplingFields(StrictBody, GenerationExtras):
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
    cache: bool | None = None  # tokenmill's: false keeps the request out of the response cache (--response-cache)
    best_of: int | None = None  # sample best_of, answer the n with the highest cumulative logprob (beams: the width)
    use_beam_search: bool = False  # vLLM's: beam search, width best_of (or n), the n best beams answered
    length_penalty: float = 1.0  # beam search: a finished beam scores cumulative logprob / length ** this
    min_tokens: int = 0  # vLLM's: no end-of-sequence, stop id or stop string before this many
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only these
    bad_words: list[str] | None = None  # vLLM's: words never generated
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: all the context holds)
    # tokenmill's: KV eviction (StreamingLLM), {"window": N, "sinks": 4}: past the window the middle tokens'
    # K/V go, and the answer may run past the context; {"policy": "none"}: off where the server evicts by default
    kv_eviction: dict[str, Any] | None = None
    # vLLM's request fields
    priority: int = 0  # with --scheduling-policy priority: lower first (refused by the engine otherwise)
    request_id: str | None = None  # the request's id (the X-Request-Id header wins), in logs and the live view
    return_tokens_as_token_ids: bool = False  # logprobs name each token "token_id:N" instead of its text
    # Special tokens kept in the text (skip_special_tokens false) are joined without spaces either way: this
    # server's tokenizers are all "fast" ones, which vLLM's detokenizer also joins without regard to this field.
    spaces_between_special_tokens: bool = True
    guided_decoding_backend: str | None = None  # must name this server's backend (guidance) or auto
    # structured output: OpenAI's response_format, vLLM's structured_outputs and guided_* aliases
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # OpenAI's, accepted with no effect (NO_EFFECT says why); functions and function_call
    # (its old tool fields), suffix and logit_bias are declared to be refused by name
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    suffix: str | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in _UNSUPPORTED:
                if data.get(name) not in (None, {}, []):
                    raise ValueError(f"{name} is not supported by this server")
        return data

    @model_validator(mode="after")
    def _vllm_fields(self) -> _SamplingFields:
        backend = self.guided_decoding_backend
        if backend is not None and backend.split(":")[0] not in GUIDED_BACKENDS:
            raise InvalidRequestError(
                f"guided_decoding_backend {backend!r}: this server's structured output runs on guidance "
                f"(llguidance); choose one of {', '.join(GUIDED_BACKENDS)} (as vLLM, a request cannot pick "
                "another backend than the server's)",
                param="guided_decoding_backend",
            )
        if self.request_id is not None:
            check_request_id(self.request_id, "request_id")
        return self

    @model_validator(mode="after")
    def _best_of_and_beams(self) -> _SamplingFields:
        if self.best_of is not None and not self.n <= self.best_of <= MAX_N:
            raise InvalidRequestError(f"best_of must be in [n, {MAX_N}] (n is {self.n})", param="best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream and not self.use_beam_search:
            raise InvalidRequestError("best_of > n cannot be streamed (the best are known at the end)", param="best_of")
        if self.length_penalty != 1.0 and not self.use_beam_search:
            raise InvalidRequestError("length_penalty needs use_beam_search", param="length_penalty")
        if self.use_beam_search:
            unset = {"min_tokens": 0, "stop": [], "stop_token_ids": [], "tools": [], "logit_bias": {}}

            def is_set(name: str) -> bool:  # False is unset (a flag off, chat's logprobs), 0 may be set (logprobs 0)
                value = getattr(self, name, None)
                if value is None or value is False:
                    return False
                return not (name in unset and type(value) is type(unset[name]) and value == unset[name])

            given = [
                name
                for name in (
                    "kv_eviction",
                    "stream",
                    "echo",
                    "return_timings",
                    "include_stop_str_in_output",
                    "top_p",
                    "top_k",
                    "min_p",
                    "seed",
                    "stop",
                    "stop_token_ids",
                    "presence_penalty",
                    "frequency_penalty",
                    "repetition_penalty",
                    "logit_bias",
                    "allowed_token_ids",
                    "bad_words",
                    "min_tokens",
                    "response_format",
                    "structured_outputs",
                    *_GUIDED,
                    "prompt_logprobs",
                    "tools",
                )
                if is_set(name)
            ]
            if self.temperature not in (None, 0, 0.0):
                given.insert(0, "temperature")
            if given:
                raise InvalidRequestError(f"use_beam_search cannot be combined with {given[0]}", param=given[0])
        return self

    @property
    def ranks_best_of(self) -> bool:
        """best_of sequences are sampled and the n best answered."""
        return self.best_of is not None and self.best_of > self.n and not self.use_beam_search

    def beam_params(self, max_tokens: int) -> BeamSearchParams:
        return BeamSearchParams(
            beam_width=self.best_of or self.n,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
        )

    def structured(self) -> StructuredOutputs | None:
        guided = {name: getattr(self, name) for name in _GUIDED}
        return structured_outputs(self.response_format, self.structured_outputs, guided, self.guided_whitespace_pattern)

    def _sampling(
        self,
        max_tokens: int,
        logprobs: int | None,
        structured: StructuredOutputs | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        def pick(value, default):
            return default if value is None else value

        return SamplingParams(
            n=self.best_of if self.ranks_best_of else self.n,
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
            logprobs=0 if logprobs is None and self.ranks_best_of else logprobs,  # ranked by cumulative logprob
            prompt_logprobs=prompt_logprobs,
            structured=structured,
            min_tokens=self.min_tokens,
            logit_bias=self._logit_bias(),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            bad_words=tuple(self.bad_words or ()),
            priority=self.priority,
            cache_salt=self.cache_salt,
            kv_eviction=self.kv_eviction if self.evicts else None,
        )

    @property
    def evicts(self) -> bool:
        """It asks for KV eviction (``kv_eviction``, unless its policy is "none")."""
        return self.kv_eviction is not None and self.kv_eviction.get("policy") != "none"

    @property
    def streams(self) -> bool:
        """It asks for StreamingLLM eviction (the default policy): not bounded by the context."""
        return self.evicts and self.kv_eviction.get("policy", "streaming") == "streaming"

    def _logit_bias(self) -> dict[int, float]:
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or len(key) > 10:
                raise InvalidRequestError(f"logit_bias keys must be token ids, not {key!r}", param="logit_bias")
            out[int(key)] = bias
        return out

    @property
    def usage_stats(self) -> str | None:
        """Where a streamed answer reports its usage: None, "final" (a last chunk, OpenAI's
        include_usage) or "continuous" (every chunk too, vLLM's continuous_usage_stats)."""
        options = self.stream_options
        if options is None or not options.include_usage:
            return None
        return "continuous" if options.continuous_usage_stats else "final"


class CompletionRequest(_SamplingFields, CompletionExtras):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False  # the prompt before the completion (with logprobs: its tokens' logprobs, the first null)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and top-k, in the choice
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (a BOS) around a text prompt

    @model_validator(mode="before")
    @classmethod
    def _no_tools(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in ("tools", "tool_choice", "parallel_tool_calls"):
                if data.get(name) not in (None, [], {}):
                    raise ValueError(f"{name} is a chat field: use /v1/chat/completions")
        return data

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt, "prompt")

    def answer_extras(self) -> AnswerExtras:
        return AnswerExtras(token_ids=self.return_token_ids)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        if self.echo and self.logprobs is not None and self.stream and self.n > 1:
            raise InvalidRequestError(
                "echo with logprobs and n > 1 cannot be streamed (each prompt is scored "
                "once, by its first sequence): stream false, or n 1",
                param="echo",
            )
        scored = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return self._sampling(max_tokens, self.logprobs, self.structured(), max(scored) if scored else None)


class ChatMessage(StrictBody):
    """One message; a field it does not know is refused, like the request's own."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's, nothing else
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call
    private: bool = False  # tokenmill's: a request with a private message is never cached (--response-cache)
    # Fields of an assistant message that clients send back as they got it (from OpenAI or vLLM): accepted
    # empty, refused with content, since nothing here would render them into the prompt; but an assistant's
    # reasoning_content (a string: what --reasoning-parser split off), which goes to the chat template.
    refusal: Any = None
    audio: Any = None
    function_call: Any = None
    annotations: Any = None
    reasoning_content: Any = None
    reasoning: Any = None  # vLLM's newer name for reasoning_content (answers carry both)

    @model_validator(mode="after")
    def _echoed_fields_empty(self) -> ChatMessage:
        for name in ("refusal", "audio", "function_call", "annotations", "reasoning_content", "reasoning"):
            if name.startswith("reasoning") and self.role == "assistant" and isinstance(getattr(self, name), str):
                continue  # an answer's reasoning sent back (--reasoning-parser): the template may render it
            if getattr(self, name) not in (None, [], ""):
                raise InvalidRequestError(f"messages with {name} are not supported", param="messages")
        return self

    def as_dict(self) -> dict[str, Any]:
        """The message for the chat template (tool fields kept for the tools renderer)."""
        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            for i, call in enumerate(self.tool_calls):
                fn = call.get("function")
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise InvalidRequestError(f"tool_calls[{i}] needs a function with a name", param="messages")
            m["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        if self.role == "assistant" and (self.reasoning_content or self.reasoning):
            # (Qwen3's template renders it for the current turn)
            m["reasoning_content"] = self.reasoning_content or self.reasoning
        return m

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError("only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields, ChatExtras):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    echo: bool = False  # vLLM's: the last message's content before the answer, when both are the assistant's
    prompt_logprobs: int | None = None  # vLLM's: the rendered prompt's tokens' logprobs, in the response
    # vLLM's: more variables for the chat template (Qwen3's {"enable_thinking": false}); none may set
    # one the server sets itself (messages, tools, add_generation_prompt, bos_token, eos_token)
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens (a BOS) on top of the template's
    continue_final_message: bool = False  # vLLM's: the last message left open, its text continued
    chat_template: str | None = None  # vLLM's: this request's own Jinja template (--trust-request-chat-template)
    documents: list[dict[str, str]] | None = None  # vLLM's: for RAG templates, given to them as `documents`

    @model_validator(mode="after")
    def _tool_results_answer_calls(self) -> ChatCompletionRequest:
        check_tool_results(self.messages)
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError(
                "cannot set both continue_final_message and add_generation_prompt to true (as vLLM): "
                "send add_generation_prompt false to continue the final message",
                param="continue_final_message",
            )
        if self.chat_template is not None and not self.chat_template.strip():
            raise InvalidRequestError("chat_template is empty", param="chat_template")
        return self

    def sampling_params(self, max_tokens: int, structured: StructuredOutputs | None = None) -> SamplingParams:
        """``structured``: the tools' constraint, if any (it excludes response_format)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        own = self.structured()
        if own is not None and structured is not None:
            raise InvalidRequestError(
                "a constrained output (response_format, structured_outputs, guided_*) cannot be "
                "combined with tools unless tool_choice is none",
                param="tool_choice",
            )
        return self._sampling(
            max_tokens, (self.top_logprobs or 0) if self.logprobs else None, own or structured, self.prompt_logprobs
        )

    def echoed(self) -> str:
        """What echo puts before the answer: the last message, if it is the assistant's
        (a reply being continued), else nothing (as vLLM's)."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def answer_extras(self) -> AnswerExtras:
        return AnswerExtras(self.return_token_ids, self.return_prompt_text, self.include_reasoning)


def chat_request(body: dict[str, Any], param: str) -> ChatCompletionRequest:
    """A chat request made from another route's body (/v1/responses, /tokenize with messages);
    its validation errors are 400s, a validator's with its own message and field, else naming
    ``param``."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        error = (first.get("ctx") or {}).get("error")
        if isinstance(error, InvalidRequestError):
            raise error from None
        where = ".".join(str(x) for x in first.get("loc", ())) or param
        raise InvalidRequestError(f"invalid request: {where}: {first.get('msg', 'malformed')}", param) from None


# The chat request's fields that shape its prompt, which /tokenize and chat embeddings take too
CHAT_RENDERING = (
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "tools",
    "chat_template",
    "mm_processor_kwargs",
    "media_io_kwargs",
)


def chat_rendering(body: BaseModel, names: tuple[str, ...], **defaults: Any) -> ChatCompletionRequest:
    """The chat request that would render ``body.messages`` (/tokenize, chat embeddings): the
    ``names`` of its rendering fields the body was sent with, else ``defaults``, else a chat's."""
    given = defaults | {name: getattr(body, name) for name in names if name in body.model_fields_set}
    return chat_request(given | {"messages": body.messages, "max_tokens": 1}, "messages")


def check_tool_results(messages: list[ChatMessage]) -> None:
    """As OpenAI's API: a tool message answers a call of an assistant message before it,
    named by its ``tool_call_id``."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            calls |= {c["id"] for c in m.tool_calls if isinstance(c, dict) and isinstance(c.get("id"), str)}
        elif m.role == "tool":
            if m.tool_call_id is None:
                raise InvalidRequestError(
                    f"messages[{i}]: a tool message needs the tool_call_id it answers", param="messages"
                )
            if m.tool_call_id not in calls:
                raise InvalidRequestError(
                    f"messages[{i}]: a tool message must answer a tool call of an earlier "
                    "assistant message (no such tool_call_id)",
                    param="messages",
                )


def prompt_list(value: str | list[int] | list[str] | list[list[int]], param: str) -> list[str | list[int]]:
    """One text, one token-id list, or a list of either, as a list of prompts."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise InvalidRequestError(f"{param} is empty", param=param)
    if all(isinstance(x, int) for x in value):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[arg-type]


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"] | None
