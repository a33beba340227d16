"""What both sides of the pipe must agree on about a request's sequences: their ids, and the
parameters a step runs them by (an embedding request counted as one step). The engine core
and the output processor each call these, in whichever process they run."""

from __future__ import annotations

import dataclasses

from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

# What the scheduler and the output processor count an embedding request by: its prompt,
# then one step that ends it (the runner pools its hidden states and samples nothing).
EMBEDDING_STEP = SamplingParams(max_tokens=1)


def step_params(params: SamplingParams | PoolingParams) -> SamplingParams:
    """The parameters the scheduler and the output processor run a request by (an embedding
    request's salt and priority kept)."""
    if not isinstance(params, PoolingParams):
        return params
    if params.cache_salt is None and params.priority == 0:
        return EMBEDDING_STEP
    return dataclasses.replace(EMBEDDING_STEP, cache_salt=params.cache_salt, priority=params.priority)


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's n sequences (the one place that names them: the engine core
    and the output processor, in whichever process, must agree)."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
