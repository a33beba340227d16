"""LLM: the offline API. Loads a model, builds the engine, runs prompts to completion.

    llm = LLM()                                   # SmolLM2-135M-Instruct, float32, CPU
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(out[0].text)
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.engine.scheduler import SchedulerConfig
from tokenmill.errors import InvalidRequestError, ModelLoadError, TokenmillError
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import load_checkpoint
from tokenmill.model.tokenizer import load_tokenizer
from tokenmill.quant.weights import quantize_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.draft import ModelProposer
from tokenmill.spec.ngram import NgramProposer
from tokenmill.spec.proposer import Proposer
from tokenmill.worker.kv_cache import allocate_kv_cache, block_bytes, check_kv_cache_dtype
from tokenmill.worker.model_runner import ModelRunner

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}  # fmt: skip

# Above this many running requests speculation pauses (bench/speculative.py measures
# where verification stops paying on a CPU).
DEFAULT_SPEC_DISABLE_BATCH_SIZE = 4


def default_kv_cache_memory() -> int:
    """A tenth of the memory available now, between 256 MiB and 2 GiB."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        available = 8 << 30
    return min(max(available // 10, 256 << 20), 2 << 30)


Messages = list[dict[str, Any]]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TokenmillError(f"device {device!r} requested but CUDA is not available on this machine")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise TokenmillError(f"unsupported dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def parse_memory(value: int | float | str | None) -> int:
    """Bytes from 1073741824, '1GiB', '512MiB', '2GB' or a float of GiB such as 1.5."""
    if value is None:
        return default_kv_cache_memory()
    if isinstance(value, (int, float)):
        return int(value) if isinstance(value, int) and value >= 1 << 20 else int(value * (1 << 30))
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    text = value.strip().lower()
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    try:
        return parse_memory(float(text) if "." in text else int(text))
    except ValueError:
        raise TokenmillError(f"cannot read memory size {value!r}; use e.g. 1GiB, 512MiB or bytes") from None


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        block_size: int = 16,
        kv_cache_memory: int | float | str | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        scheduling: str = "continuous",
        speculative: str | None = None,
        num_speculative_tokens: int = 4,
        draft_model: str | None = None,
        draft_layers: int | None = None,
        spec_disable_batch_size: int = DEFAULT_SPEC_DISABLE_BATCH_SIZE,
        prompt_lookup_max: int = 4,
        prompt_lookup_min: int = 1,
        quantization: str = "none",
        quantization_group_size: int = 32,
        kv_cache_dtype: str = "auto",
        progress: bool = True,
    ) -> None:
        scheduler_config = _scheduler_config(max_num_seqs, max_num_batched_tokens, scheduling)
        spec_config = _speculative_config(
            speculative, num_speculative_tokens, draft_model, draft_layers, spec_disable_batch_size,
            prompt_lookup_max, prompt_lookup_min,
        )  # fmt: skip
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        ckpt = load_checkpoint(model, self.dtype, progress=progress)
        self.model_path = ckpt.path
        self.config = ckpt.config
        self.tokenizer = load_tokenizer(ckpt.path, ckpt.metadata)
        self.model = LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights, self.device)
        del ckpt
        try:
            check_kv_cache_dtype(kv_cache_dtype)
            quantize_model(self.model, quantization, quantization_group_size)
        except ValueError as e:
            raise TokenmillError(str(e)) from None
        self.quantization, self.kv_cache_dtype = quantization, kv_cache_dtype
        self.quantization_group_size = quantization_group_size
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings, self.config.max_position_embeddings)
        draft = None
        if spec_config is not None and spec_config.method == "draft":
            draft = self._load_draft(spec_config.draft_model, progress)
        per_block = block_bytes(self.config, block_size, self.dtype, kv_cache_dtype)
        if draft is not None:  # the draft's cache shares block ids: every block costs both
            per_block += block_bytes(draft.config, block_size, self.dtype, kv_cache_dtype)
        num_blocks = parse_memory(kv_cache_memory) // per_block
        if num_blocks < 1:
            raise TokenmillError(f"kv_cache_memory={kv_cache_memory!r} is smaller than one KV block")
        kv_caches = allocate_kv_cache(self.config, num_blocks, block_size, self.dtype, self.device, kv_cache_dtype)
        proposer = None
        if spec_config is not None:
            proposer = self._proposer(spec_config, draft, kv_caches, num_blocks, block_size)
        runner = ModelRunner(self.model, kv_caches, block_size, self.device, proposer)
        self.num_blocks = num_blocks
        self.engine = Engine(
            runner,
            self.tokenizer,
            EngineConfig(
                num_blocks=num_blocks,
                block_size=block_size,
                max_model_len=self.max_model_len,
                enable_prefix_caching=enable_prefix_caching,
                scheduler=scheduler_config,
                speculative=spec_config,
            ),
        )
        self._ids = itertools.count()

    def _load_draft(self, path: str | None, progress: bool) -> LlamaForCausalLM:
        """Load the draft model; refuse one whose vocabulary differs from the target's."""
        ckpt = load_checkpoint(path, self.dtype, progress=progress)
        if ckpt.config.vocab_size != self.config.vocab_size:
            raise TokenmillError(
                f"draft model {path} has a vocabulary of {ckpt.config.vocab_size} tokens but the target's has "
                f"{self.config.vocab_size}: a draft must share the target's tokenizer"
            )
        try:
            draft_tokenizer = load_tokenizer(ckpt.path, ckpt.metadata)
        except ModelLoadError:
            draft_tokenizer = None  # weights only: the vocabulary size has to do
        if draft_tokenizer is not None and draft_tokenizer.backend.get_vocab() != self.tokenizer.backend.get_vocab():
            raise TokenmillError(f"draft model {path} has a different tokenizer vocabulary from the target's")
        draft = LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights, self.device)
        return quantize_model(draft, self.quantization, self.quantization_group_size)

    def _proposer(
        self, spec: SpeculativeConfig, draft: LlamaForCausalLM | None, kv_caches: list, num_blocks: int, block_size: int
    ) -> Proposer:
        if spec.method == "ngram":
            return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
        if spec.method == "self":
            assert spec.draft_layers is not None
            if spec.draft_layers >= self.config.num_layers:
                raise TokenmillError(
                    f"draft_layers={spec.draft_layers} must be below the model's {self.config.num_layers} layers"
                )
            return ModelProposer(self.model, kv_caches, block_size, self.device, spec.draft_layers, catch_up=False)
        assert draft is not None
        draft_caches = allocate_kv_cache(draft.config, num_blocks, block_size, self.dtype, self.device, self.kv_cache_dtype)
        return ModelProposer(draft, draft_caches, block_size, self.device)

    # ----------------------------------------------------------------- offline

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = _per_prompt(sampling_params, len(prompts))
        rids = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                rid = str(next(self._ids))
                self.engine.add_request(rid, p, sp)
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

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c), add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params)  # type: ignore[arg-type]

    def stream(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
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
        return self.engine.kv.stats

    @property
    def spec_decode_stats(self):
        return self.engine.spec_stats


def _scheduler_config(max_num_seqs: int, max_num_batched_tokens: int, scheduling: str) -> SchedulerConfig:
    try:
        return SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, policy=scheduling)
    except ValueError as e:
        raise TokenmillError(str(e)) from None


def _speculative_config(
    method: str | None, k: int, draft_model: str | None, draft_layers: int | None, disable_batch_size: int,
    lookup_max: int, lookup_min: int,
) -> SpeculativeConfig | None:  # fmt: skip
    if method is None or method == "none":
        return None
    try:
        return SpeculativeConfig(
            method=method,
            num_speculative_tokens=k,
            prompt_lookup_max=lookup_max,
            prompt_lookup_min=lookup_min,
            draft_model=draft_model,
            draft_layers=draft_layers,
            disable_batch_size=disable_batch_size,
        )
    except ValueError as e:
        raise TokenmillError(str(e)) from None


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise InvalidRequestError(f"got {len(params)} SamplingParams for {n} prompts")
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
    )
