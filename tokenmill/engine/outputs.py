"""What the engine hands back: per-request outputs, as plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.request import RequestTimings


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    timings: list[RequestTimings] = field(default_factory=list)
    # Streaming: what this step added to each completion.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
