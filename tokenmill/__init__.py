"""tokenmill: an LLM inference and serving engine on PyTorch."""

from tokenmill.llm import LLM, RequestOutput
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
