"""PoolingParams: an embedding request's controls (vLLM's name), validated on construction.

An embedding request computes its prompt, sharing steps with generation, and ends with
the model's final hidden state pooled and L2-normalised; it samples nothing. It is a
request of its own kind, not a one-token generation: the engine core queues it beside
generating requests and the runner pools instead of sampling. Free of torch, like
``SamplingParams``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.errors import InvalidRequestError

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    # "last": the final hidden state at the last token (what decoder embedding models
    # use); "mean": the mean over all the prompt's tokens (such a request skips the
    # prefix cache: a cached position has no hidden state to average).
    pooling_type: str = "last"
    client: str = ""  # whom it is for, opaque: as SamplingParams.client
    cache_salt: str | None = None  # as SamplingParams.cache_salt: prefix-cache blocks shared only within a salt
    priority: int = 0  # as SamplingParams.priority

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}", param="pooling"
            )
        if not isinstance(self.client, str):
            raise InvalidRequestError(f"client must be a string, got {self.client!r}", param="client")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {self.priority!r}", param="priority")

    @property
    def n(self) -> int:
        """Sequences the request becomes: one, as for any request a front counts."""
        return 1
