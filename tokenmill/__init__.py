"""tokenmill: an LLM inference and serving engine on PyTorch.

The package's names load on first use (a module ``__getattr__``), so that the engine's
bookkeeping (``tokenmill.engine``) and ``tokenmill --help`` import without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.beam_search import BeamSearchParams
    from tokenmill.configuration.config import EngineArgs
    from tokenmill.llm import LLM, RequestOutput
    from tokenmill.pooling_params import PoolingParams
    from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "BeamSearchParams", "EngineArgs", "PoolingParams", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_HOMES = {
    "LLM": "tokenmill.llm",
    "BeamSearchParams": "tokenmill.beam_search",
    "RequestOutput": "tokenmill.llm",
    "EngineArgs": "tokenmill.configuration.config",
    "SamplingParams": "tokenmill.sampling_params",
    "PoolingParams": "tokenmill.pooling_params",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value
