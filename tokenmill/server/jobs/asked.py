"""What one chat or completions request asked for, as its answer needs it: the prompts and
their sampling parameters, and every choice about the answer's shape (chat or completions,
tools, reasoning, echo, logprobs, best_of, usage, timings, vLLM's extras). Made once by the
route, read by the job that runs it (job.py), the whole answer (answer.py) and the stream
(sse.py); never changed."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.jobs.prompts import ContextShift
from tokenmill.server.jobs.reasoning import Reasoning
from tokenmill.server.jobs.tools import ToolRequest
from tokenmill.server.protocol.vllm_fields import AnswerExtras


@dataclass(frozen=True)
class Asked:
    """Choice i*n + j of the answer is sequence j of prompt i (n: the prompts' ``params[0].n``)."""

    prefix: str  # the answer's id prefix: "chatcmpl" or "cmpl"
    object: str  # "chat.completion" or "text_completion"
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per prompt, as the client asked (a router may ask the engine for more)
    chat: bool
    usage_stats: str | None = None  # streamed usage: None, "final" (a last chunk) or "continuous" (every chunk)
    return_timings: bool = False
    tools: ToolRequest | None = None  # chat with tools: answers are parsed into tool calls
    reasoning: Reasoning | None = None  # chat, --reasoning-parser: answers split into reasoning_content and content
    echoes: list[str] | None = None  # per prompt: the text echo puts before each of its answers
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field (echo alone scores the prompt too)
    best_of_keep: int | None = None  # best_of: the n kept per prompt, by cumulative logprob
    logprobs: bool = True  # the client asked for logprobs (best_of and a router's cascade ask the engine anyway)
    request_id: str | None = None  # the client's X-Request-Id or request_id: the answer's id
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    extras: AnswerExtras = field(default_factory=AnswerExtras)  # return_token_ids, return_prompt_text, ...
    context_shift: ContextShift | None = None  # what a chat's context shift dropped (prompts.py)
    prompt_only: bool = False  # echo with max_tokens 0: the prompt scored, the one token run for it dropped

    @property
    def per_prompt(self) -> int:
        return self.params[0].n

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)

    def echo(self, index: int) -> str:
        """The echoed prompt text before choice ``index``'s answer ("" without echo)."""
        return self.echoes[index // self.per_prompt] if self.echoes else ""
