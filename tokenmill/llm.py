"""LLM: the offline API. Loads a model, builds the engine, runs prompts to completion.

llm = LLM()                                   # SmolLM2-135M-Instruct, float32, CPU
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
print(out[0].text)
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from tokenmill.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from tokenmill.configuration.args import engine_args
from tokenmill.configuration.config import EngineArgs
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.errors import InvalidRequestError
from tokenmill.factory import build_engine
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

Params = SamplingParams | PoolingParams  # what a prompt runs with: generation, or an embedding

Messages = list[dict[str, Any]]

# An offline batch has no one waiting on each token: its steps take a budget of this many tokens
# unless told otherwise (vLLM's offline default on a CPU), so long prompts prefill in few big
# steps. A server keeps SchedulerConfig's 512, which holds decode latency under load.
OFFLINE_BATCHED_TOKENS = 4096


class LLM:
    """The offline API. Keywords are the engine options (``tokenmill.configuration.config``; the CLI
    flags of the same names): ``LLM(max_num_seqs=32, speculative="ngram")``, or a whole
    ``EngineArgs`` as ``args``. Unless given, ``max_num_batched_tokens`` is
    OFFLINE_BATCHED_TOKENS (the server's default is 512)."""

    def __init__(
        self, model: str | None = None, *, args: EngineArgs | None = None, progress: bool = True, **options: Any
    ) -> None:
        if args is None:
            args = engine_args(model=model, **{"max_num_batched_tokens": OFFLINE_BATCHED_TOKENS, **options})
        elif model is not None or options:
            raise TypeError("pass either args or keywords, not both")
        parts = build_engine(args, progress=progress)
        self.parts = parts
        self.args = args
        assert parts.engine is not None  # build_engine makes one unless asked for the core alone
        self.engine = parts.engine
        self.model = parts.model
        self.tokenizer = parts.tokenizer
        self.config = parts.model_config
        self.model_path = parts.model_path
        self.device = parts.device
        self.dtype = parts.dtype
        self.max_model_len = parts.max_model_len
        self.num_blocks = parts.num_blocks
        self.quantization = args.load.quantization
        self.quantization_group_size = args.load.quantization_group_size
        self.kv_cache_dtype = args.cache.kv_cache_dtype
        self._ids = itertools.count()
        # A split model's worker processes end with this object (or at exit), not later.
        self._finalizer = weakref.finalize(self, parts.close)

    def close(self) -> None:
        """Stop the worker processes of a split model (tensor / pipeline parallel) and write
        what the prefix cache's disk tier has queued. Also done when the LLM is
        garbage-collected or Python exits."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- offline

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: Params | Sequence[Params] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. ``lora``: the
        adapter (name given to ``load_lora`` or ``lora_modules``) for all prompts, or one per
        prompt (None: the base model). A prompt with ``PoolingParams`` is embedded (its
        output's ``embedding``), in the same steps as the others."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = [
            p.with_bad_word_ids(self.tokenizer) if isinstance(p, SamplingParams) else p
            for p in _per_prompt(sampling_params, len(prompts))
        ]
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise InvalidRequestError(f"got {len(loras)} LoRA adapters for {len(prompts)} prompts")
        rids = []
        try:
            for p, sp, adapter in zip(prompts, params, loras, strict=True):
                rid = str(next(self._ids))
                self.engine.add_request(rid, p, sp, lora=adapter)
                rids.append(rid)
            done: dict[str, dict[int, RequestOutput]] = {rid: {} for rid in rids}
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished and out.request_id in done:
                        done[out.request_id][out.outputs[0].index] = out
        except BaseException:
            for rid in rids:  # nothing is left behind: an error or Ctrl-C frees every block
                self.engine.abort(rid)
            raise
        return [_merge(rid, [done[rid][i] for i in sorted(done[rid])]) for rid in rids]

    def embed(
        self,
        texts: str | Sequence[str] | Sequence[Sequence[int]],
        pooling: str = "last",
        lora: str | Sequence[str | None] | None = None,
    ) -> list[list[float]]:
        """One L2-normalised embedding per text (or token-id list): the model's final
        hidden state at the last token (``pooling="last"``, what decoder embedding
        models use) or the mean over all tokens (``"mean"``). The texts run through
        the same engine as generation, prefill only."""
        outs = self.generate(texts, PoolingParams(pooling), lora)
        return [o.embedding for o in outs]  # type: ignore[misc]

    def beam_search(
        self, prompts: str | Sequence[str] | Sequence[Sequence[int]], params: BeamSearchParams, lora: str | None = None
    ) -> list[BeamSearchOutput]:
        """Beam search (``tokenmill.beam_search``): per prompt, ``params.beam_width``
        beams, best first, each with its tokens, text and cumulative logprob."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        search = BeamSearch(ids, params, frozenset(self.engine.core.scheduler.eos_token_ids))
        while not search.finished:
            round_ = search.requests()
            outs = self.generate([r[2] for r in round_], params.step_params(), lora)
            search.advance(
                {(p, b): out.outputs[0].top_logprobs[0] for (p, b, _), out in zip(round_, outs, strict=True)}
            )
        return search.results()

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
        allow_special_tokens: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate. Special-token
        text in the messages is tokenised as text (``allow_special_tokens``: as special
        tokens, as the rendered prompt reads). ``chat_template_kwargs``: more variables for
        the template, as vLLM's (Qwen3's ``{"enable_thinking": False}``)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.encode_chat(
                c, allow_special_tokens=allow_special_tokens, template_kwargs=chat_template_kwargs
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, lora)  # type: ignore[arg-type]

    def load_lora(self, name: str, path: str) -> None:
        """Serve a PEFT adapter folder under ``name`` (needs ``enable_lora=True``)."""
        self.engine.core.add_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.core.remove_lora(name)

    def stream(
        self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield one output per generated token (its delta_text), the last with finished=True."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise InvalidRequestError("stream() takes n=1")
        rid = f"stream-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)

    @property
    def prefix_cache_stats(self):
        return self.engine.core.prefix_cache_stats

    @property
    def spec_decode_stats(self):
        return self.engine.core.spec_decode_stats


def _per_prompt(params: Params | Sequence[Params] | None, n: int) -> list[Params]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams | PoolingParams):
        return [params] * n
    if len(params) != n:
        raise InvalidRequestError(f"got {len(params)} parameter sets for {n} prompts")
    return list(params)


def _merge(request_id: str, outs: list[RequestOutput]) -> RequestOutput:
    completions: list[CompletionOutput] = [o.outputs[0] for o in outs]
    first = outs[0]
    return RequestOutput(
        request_id=request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=completions,
        finished=True,
        timings=[t for o in outs for t in o.timings],
        num_cached_tokens=first.num_cached_tokens,
        prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None),
        prompt_top_logprobs=next((o.prompt_top_logprobs for o in outs if o.prompt_top_logprobs is not None), None),
        prompt_ranks=next((o.prompt_ranks for o in outs if o.prompt_ranks is not None), None),
        embedding=first.embedding,
    )
