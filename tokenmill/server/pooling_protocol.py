"""Request bodies of the routes that answer with the model's pooled states rather than
generated text: ``/v1/embeddings``, ``/pooling``, and vLLM's scoring routes for RAG
(``/score``, ``/rerank``). Validated as every body is (protocol.py's ``StrictBody``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator, model_validator

from tokenmill.errors import InvalidRequestError
from tokenmill.server.protocol import StrictBody, prompt_list


class EmbeddingRequest(StrictBody):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each input's last k tokens (-1: the context's worth)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    pooling: Literal["last", "mean"] = "last"  # tokenmill's: the last token's final hidden state, or the mean

    def inputs(self) -> list[str | list[int]]:
        return prompt_list(self.input, "input")


class PoolingRequest(StrictBody):
    """vLLM's /pooling: each input's pooled state (here the embeddings' normalised final hidden state)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None
    encoding_format: Literal["float", "base64"] = "float"
    pooling: Literal["last", "mean"] = "last"

    def inputs(self) -> list[str | list[int]]:
        return prompt_list(self.input, "input")


class ScoreRequest(StrictBody):
    """vLLM's /score: text_1 against each text_2 (1:1, 1:N), or pairwise (N:N)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    pooling: Literal["last", "mean"] = "last"  # tokenmill's, as the embeddings'

    def texts(self) -> tuple[list[str], list[str]]:
        return _texts(self.text_1), _texts(self.text_2)

    @model_validator(mode="after")
    def _pairs(self) -> ScoreRequest:
        first, second = self.texts()
        for name, texts in (("text_1", first), ("text_2", second)):
            if not texts:
                raise InvalidRequestError(f"{name} is empty", param=name)
        if len(first) > 1 and len(first) != len(second):
            raise InvalidRequestError(
                f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1 (scored against "
                "each text_2) or as many as text_2 (scored pairwise)",
                param="text_2",
            )
        return self


def _texts(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


class RerankRequest(StrictBody):
    """The Jina / Cohere rerank body, as vLLM's /rerank takes it."""

    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]]  # texts, or Cohere's {"text": ...}
    top_n: int | None = None  # the best top_n results (None or 0: all)
    return_documents: bool = True  # each result's document text
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
