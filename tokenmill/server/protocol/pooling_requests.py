"""Request bodies of the routes that answer with the model's pooled states rather than
generated text: ``/v1/embeddings``, ``/pooling``, and vLLM's scoring routes for RAG
(``/score``, ``/rerank``). Validated as every body is (openai.py's ``StrictBody``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import field_validator, model_validator

from tokenmill.errors import InvalidRequestError
from tokenmill.server.protocol.openai import (
    CHAT_RENDERING,
    ChatCompletionRequest,
    ChatMessage,
    StrictBody,
    chat_rendering,
    prompt_list,
)
from tokenmill.server.protocol.vllm_fields import POOLING_CANNOT, EncodingExtras, PoolingExtras


class EmbeddingRequest(StrictBody, PoolingExtras, EncodingExtras):
    """OpenAI's embeddings body, or vLLM's chat form: ``messages`` rendered through the chat
    template (its fields as vLLM's EmbeddingChatRequest has them) and embedded as one input."""

    _cannot: ClassVar[dict[str, str]] = {k: v for k, v in POOLING_CANNOT.items() if k != "chat_template_kwargs"}
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    media_io_kwargs: dict[str, Any] | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each input's last k tokens (-1: the context's worth)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    pooling: Literal["last", "mean"] = "last"  # tokenmill's: the last token's final hidden state, or the mean

    def inputs(self) -> list[str | list[int]]:
        """The texts or token-id lists of ``input`` (the chat form has ``as_chat`` instead)."""
        assert self.input is not None
        return prompt_list(self.input, "input")

    @model_validator(mode="after")
    def _one_form(self) -> EmbeddingRequest:
        if (self.input is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of input and messages", param="input")
        chat_only = [n for n in ("chat_template_kwargs", "chat_template") if getattr(self, n) is not None]
        if self.messages is None and chat_only:
            raise InvalidRequestError(f"{chat_only[0]} goes with messages", param=chat_only[0])
        return self

    def as_chat(self) -> ChatCompletionRequest:
        """The messages and their template fields as the chat request that would render them
        (vLLM's chat embeddings: no generation prompt, no special tokens by default)."""
        return chat_rendering(self, CHAT_RENDERING, add_generation_prompt=False)


class PoolingRequest(StrictBody, PoolingExtras, EncodingExtras):
    """vLLM's /pooling: each input's pooled state (here the embeddings' normalised final hidden state)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None
    encoding_format: Literal["float", "base64"] = "float"
    pooling: Literal["last", "mean"] = "last"

    def inputs(self) -> list[str | list[int]]:
        return prompt_list(self.input, "input")


# vLLM's names for the two sides of a score request: the first pair, and its newer ones
SCORE_NAMES = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"))


class ScoreRequest(StrictBody, PoolingExtras):
    """vLLM's /score: the first side against each text of the second (1:1, 1:N), or pairwise
    (N:N); the sides named text_1/text_2, or as vLLM's newer requests name them."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    user: str | None = None  # an end-user id (protocol.NO_EFFECT)
    truncate_prompt_tokens: int | None = None
    pooling: Literal["last", "mean"] = "last"  # tokenmill's, as the embeddings'

    def names(self) -> tuple[str, str]:
        """The pair of fields the request gave its two sides in."""
        given = {name for pair in SCORE_NAMES for name in pair if getattr(self, name) is not None}
        pairs = [pair for pair in SCORE_NAMES if set(pair) == given]
        if not pairs:
            raise InvalidRequestError(
                "give the two sides as text_1 and text_2, or as data_1 and data_2, queries and documents, or "
                f"queries and items (got {', '.join(sorted(given)) or 'none'})",
                param="text_1",
            )
        return pairs[0]

    def texts(self) -> tuple[list[str], list[str]]:
        first, second = self.names()
        return _texts(getattr(self, first)), _texts(getattr(self, second))

    @model_validator(mode="after")
    def _pairs(self) -> ScoreRequest:
        names = self.names()
        first, second = self.texts()
        for name, texts in zip(names, (first, second), strict=True):
            if not texts:
                raise InvalidRequestError(f"{name} is empty", param=name)
        if len(first) > 1 and len(first) != len(second):
            raise InvalidRequestError(
                f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: give one {names[0]} (scored "
                f"against each of {names[1]}) or as many as {names[1]} (scored pairwise)",
                param=names[1],
            )
        return self


def _texts(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


class RerankRequest(StrictBody, PoolingExtras):
    """The Jina / Cohere rerank body, as vLLM's /rerank takes it."""

    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]]  # texts, or Cohere's {"text": ...}
    top_n: int | None = None  # the best top_n results (None or 0: all)
    return_documents: bool = True  # each result's document text
    user: str | None = None  # an end-user id (protocol.NO_EFFECT)
    truncate_prompt_tokens: int | None = None
    pooling: Literal["last", "mean"] = "last"  # tokenmill's, as the embeddings'

    @field_validator("documents")
    @classmethod
    def _documents(cls, value: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
        if not value:
            raise InvalidRequestError("documents is empty", param="documents")
        for i, d in enumerate(value):
            if isinstance(d, dict) and (set(d) != {"text"} or not isinstance(d["text"], str)):
                raise InvalidRequestError(
                    f'documents[{i}] must be a string or an object {{"text": "..."}} with nothing else',
                    param="documents",
                )
        return value

    @field_validator("top_n")
    @classmethod
    def _top_n(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise InvalidRequestError("top_n must be 0 (all) or more", param="top_n")
        return value

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d["text"] for d in self.documents]
