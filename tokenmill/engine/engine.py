"""The engine in one process: the engine core plus output processing.

``Engine.step`` is the core's step (engine/core/engine_core.py: schedule, compute, apply, as
token ids) followed by the output processor's (detokenise, stop strings, logprobs,
``RequestOutput``); a sequence a stop string ended is handed back to the core to
finish. The offline ``LLM`` and the threaded ``AsyncEngine`` drive this class;
``tokenmill serve`` splits the same two halves over two processes (the core in
core_loop.py, the output processor in core_client.py), so both paths share every
line that decides a token or a text.

``Engine`` holds its core (``engine.core``) rather than being one: it takes text
where the core takes token ids, and everything else about scheduling, blocks,
adapters and statistics is asked of the core by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenmill.engine.api.output_processor import OutputProcessor
from tokenmill.engine.core.engine_core import (  # noqa: F401 - re-exported: callers build engines from here
    EngineConfig,
    EngineCore,
    LoRAInfo,
    Runner,
    TokenizerInfo,
)
from tokenmill.engine.core.request import Request
from tokenmill.engine.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.grammar import CompiledGrammar, GrammarCompiler


class TextTokenizer(TokenizerInfo, Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Engine:
    """The engine core and the output processor in one process: text in, ``RequestOutput`` out."""

    def __init__(self, core: EngineCore, tokenizer: TextTokenizer) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.outputs = OutputProcessor(tokenizer)

    @classmethod
    def create(
        cls, runner: Runner, tokenizer: TextTokenizer, config: EngineConfig, grammars: GrammarCompiler | None = None
    ) -> Engine:
        """An engine over a new core."""
        return cls(EngineCore(runner, tokenizer, config, grammars), tokenizer)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams,
        add_special_tokens: bool = True,
        grammar: CompiledGrammar | None = None,
        lora: str | None = None,
    ) -> list[Request]:
        """Queue a request (text or token ids); n > 1 becomes n sequences sharing the
        prompt's KV blocks."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            text, ids = None, list(prompt)
        reqs = self.core.add_request(request_id, ids, params, grammar=grammar, lora=lora)
        for r in reqs:
            self.outputs.add(r.request_id, request_id, r.index, text, ids, r.params)
        return reqs

    def abort(self, request_id: str) -> list[str]:
        seq_ids = self.core.abort(request_id)
        for sid in seq_ids:
            self.outputs.abort(sid)
        return seq_ids

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        outputs, stopped = self.outputs.process(self.core.run_step())
        for seq_id, stop_string in stopped:
            self.core.finish_stopped(seq_id, stop_string)
        return outputs
