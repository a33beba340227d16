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

from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.engine.scheduler import SchedulerConfig
from tokenmill.errors import InvalidRequestError, TokenmillError
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import load_checkpoint
from tokenmill.model.tokenizer import load_tokenizer
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.kv_cache import allocate_kv_cache, num_blocks_for_memory
from tokenmill.worker.model_runner import ModelRunner

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}  # fmt: skip

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
        progress: bool = True,
    ) -> None:
        scheduler_config = _scheduler_config(max_num_seqs, max_num_batched_tokens, scheduling)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        ckpt = load_checkpoint(model, self.dtype, progress=progress)
        self.model_path = ckpt.path
        self.config = ckpt.config
        self.tokenizer = load_tokenizer(ckpt.path, ckpt.metadata)
        self.model = LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights, self.device)
        del ckpt
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings, self.config.max_position_embeddings)
        num_blocks = num_blocks_for_memory(self.config, parse_memory(kv_cache_memory), block_size, self.dtype)
        if num_blocks < 1:
            raise TokenmillError(f"kv_cache_memory={kv_cache_memory!r} is smaller than one KV block")
        kv_caches = allocate_kv_cache(self.config, num_blocks, block_size, self.dtype, self.device)
        runner = ModelRunner(self.model, kv_caches, block_size, self.device)
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
            ),
        )
        self._ids = itertools.count()

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


def _scheduler_config(max_num_seqs: int, max_num_batched_tokens: int, scheduling: str) -> SchedulerConfig:
    try:
        return SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, policy=scheduling)
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
