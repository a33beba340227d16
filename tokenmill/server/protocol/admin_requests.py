"""Request bodies of the admin routes: ``/tokenize`` (a prompt, or messages rendered as the chat
request would render them), ``/detokenize``, and the LoRA adapters loaded and unloaded while
serving. Validated as every body is (openai.py's ``StrictBody``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from tokenmill.errors import InvalidRequestError
from tokenmill.server.protocol.openai import (
    CHAT_RENDERING,
    ChatCompletionRequest,
    ChatMessage,
    StrictBody,
    chat_rendering,
)


class TokenizeRequest(StrictBody):
    """vLLM's two tokenize requests in one: a ``prompt``, or ``messages`` rendered as a chat
    request renders them (its template fields: vLLM's TokenizeChatRequest)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # (with messages, only when sent: a chat's default is false, as vLLM's)
    return_token_strs: bool = False  # vLLM's: each token's string too
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: with messages, as a chat request's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None

    def as_chat(self) -> ChatCompletionRequest:
        """The messages and their rendering fields as the chat request that would render them."""
        return chat_rendering(self, CHAT_RENDERING)


class LoRAAdapterRequest(StrictBody):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str | None = None
    model: str | None = None  # tokenmill's: the served model the adapter is for (several models; default: the first)

    @field_validator("lora_name", "lora_path")
    @classmethod
    def _no_nul(cls, value: str | None, info: Any) -> str | None:
        if value is not None and "\x00" in value:
            raise InvalidRequestError(f"{info.field_name} contains a NUL byte", param=info.field_name)
        return value


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int]
