"""vLLM's request fields beyond OpenAI's that the other modules of protocol do not carry: each one
does here what it does in vLLM, or what it means here, or is refused with a 400 that says why it
cannot apply (never ignored: a client that sets one relies on it).

Done: ``cache_salt`` (prefix-cache blocks shared only within a salt), ``return_token_ids`` (the
prompt's and each answer's token ids), ``return_prompt_text`` (the rendered prompt),
``reasoning_effort`` (into the chat template, as vLLM passes it), ``include_reasoning`` (false: the
answer without its reasoning), ``truncation_side`` (which end ``truncate_prompt_tokens`` keeps),
``modalities`` (text). Refused when set: those in ``CANNOT``, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, model_validator

from tokenmill.errors import InvalidRequestError

_TEXT_ONLY = "every model this server serves is text-only: there is no media to process"
CANNOT = {
    "kv_transfer_params": "KV moves between engines here by the server's own disaggregation (--prefill-replicas, "
    "--decode-replicas): a client does not hand it transfer parameters",
    "ec_transfer_params": "encoder caches belong to multimodal models; " + _TEXT_ONLY,
    "mm_processor_kwargs": _TEXT_ONLY,
    "media_io_kwargs": _TEXT_ONLY,
    "mm_payload": _TEXT_ONLY,
    "return_mm_kwargs": _TEXT_ONLY,
    "prompt_embeds": "prompts are token ids or text here; embeddings as input are not taken",
    "vllm_xargs": "it carries arguments for custom logits-processor plugins, and this server loads none",
    "logits_processors": "per-request logits processors would run a client's code in the server",
    "thinking_token_budget": "a cap on thinking tokens is not implemented here; use max_tokens",
    "logprob_token_ids": "logprobs of chosen token ids are not implemented here; use logprobs / top_logprobs",
    "repetition_detection": "repetition detection is not implemented here; use repetition_penalty",
    "routed_experts_prompt_start": "the routed-experts trace is not recorded here",
    "watermarking": "watermarking is not implemented here",
    "return_token_offsets": "token offsets are not returned here; return_token_ids gives the tokens",
    "session_id": "streaming-input sessions are not implemented here",
    "structural_tag": "structural tags are not implemented here; use structured_outputs or response_format",
    "verbosity": "OpenAI's length hint for its reasoning models; no model here reads it",
}


# the same on the routes that embed texts (embeddings, pooling, score, rerank)
POOLING_CANNOT = {
    "mm_processor_kwargs": _TEXT_ONLY,
    "media_io_kwargs": _TEXT_ONLY,
    "use_activation": "scores here are cosine similarities of embeddings: there is no classifier head to activate",
    "instruction": "texts are embedded as they are: no instruction template is applied here",
    "chat_template_kwargs": "texts are embedded as they are, through no chat template",
    "max_tokens_per_doc": "per-side limits are not implemented here; use truncate_prompt_tokens",
    "max_tokens_per_query": "per-side limits are not implemented here; use truncate_prompt_tokens",
    "padding": "each text is computed at its own length here: there is no padding to choose",
}


def _is_set(value: Any) -> bool:
    return value not in (None, False, {}, [], "")


class _Refused(BaseModel):
    """Declared so that a client that sends them empty (as some SDKs do) is served, and one that
    sets them learns why they cannot apply."""

    _cannot: ClassVar[dict[str, str]] = CANNOT

    @model_validator(mode="after")
    def _refuse_what_cannot_apply(self) -> _Refused:
        cannot = type(self)._cannot
        for name in type(self).model_fields:
            if name in cannot and _is_set(getattr(self, name)):
                raise InvalidRequestError(f"{name} cannot apply here: {cannot[name]}", param=name)
        return self


class GenerationExtras(_Refused):
    """vLLM's fields of both chat and completion requests."""

    cache_salt: str | None = None
    return_token_ids: bool = False
    truncation_side: Literal["left", "right"] | None = None
    stream_interval: int = 1
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    mm_payload: Any = None
    return_mm_kwargs: bool = False
    vllm_xargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    logprob_token_ids: list[int] | None = None
    repetition_detection: Any = None
    routed_experts_prompt_start: int | None = None
    watermarking: Any = None
    return_token_offsets: bool = False
    session_id: str | None = None

    @model_validator(mode="after")
    def _checked(self) -> GenerationExtras:
        if self.cache_salt is not None and not self.cache_salt:
            raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")
        if self.stream_interval != 1:
            raise InvalidRequestError(
                "stream_interval cannot apply here: every token is streamed as it is made (1)", param="stream_interval"
            )
        return self


class ChatExtras(_Refused):
    """vLLM's (and OpenAI's newer) fields of a chat request only."""

    reasoning_effort: str | None = None
    include_reasoning: bool = True
    return_prompt_text: bool = False
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    modalities: list[str] | None = None
    verbosity: str | None = None
    structural_tag: Any = None
    logits_processors: Any = None

    @model_validator(mode="after")
    def _text_only(self) -> ChatExtras:
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise InvalidRequestError(f"modalities {self.modalities}: this server answers in text only", "modalities")
        return self


class CompletionExtras(_Refused):
    prompt_embeds: Any = None


class PoolingExtras(_Refused):
    """vLLM's fields of the requests that embed texts: done here are ``add_special_tokens``,
    ``cache_salt``, ``truncation_side``, ``priority`` (with --scheduling-policy priority) and
    ``request_id`` (names the engine requests); the rest refused when set (POOLING_CANNOT)."""

    _cannot: ClassVar[dict[str, str]] = POOLING_CANNOT
    add_special_tokens: bool = True
    cache_salt: str | None = None
    truncation_side: Literal["left", "right"] | None = None
    priority: int = 0
    request_id: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    use_activation: bool | None = None
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens_per_doc: int | None = None
    max_tokens_per_query: int | None = None
    padding: Any = None

    @model_validator(mode="after")
    def _salt(self) -> PoolingExtras:
        if self.cache_salt is not None and not self.cache_salt:
            raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")
        return self


class EncodingExtras(BaseModel):
    """vLLM's encoding of a base64 vector: its element type and byte order."""

    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"


@dataclass(frozen=True)
class AnswerExtras:
    """What a request asks to find in its answer beyond OpenAI's fields."""

    token_ids: bool = False  # the prompt's token ids (prompt_token_ids) and each answer's (token_ids)
    prompt_text: bool = False  # the rendered prompt (prompt_text)
    reasoning: bool = True  # with a reasoning parser: the reasoning in the answer (false: content only)
