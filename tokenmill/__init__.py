"""tokenmill: an LLM inference and serving engine on PyTorch."""

from tokenmill.config import EngineArgs
from tokenmill.llm import LLM, RequestOutput
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "EngineArgs", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
