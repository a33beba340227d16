"""build_engine: EngineArgs -> a loaded model, its KV cache, a runner and an Engine.

The one place that wires the parts together (``LLM``, ``serve``, ``plan``,
``evaluate`` and the benchmarks all come through here), and the one place where
derived values are computed: the device, the dtype, the context window and the
number of KV blocks the memory budget buys (``kv_cache_sizing``).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.configuration.config import EngineArgs, ModelConfig, SpeculativeConfig, StructuredConfig
from tokenmill.configuration.memory import parse_memory
from tokenmill.distributed.cluster import Cluster, rank_device, threads_per_rank
from tokenmill.distributed.rank_messages import Load, Setup
from tokenmill.distributed.runner import DistributedRunner
from tokenmill.distributed.stage import parallel_stage
from tokenmill.engine.core.engine_core import EngineConfig, EngineCore
from tokenmill.engine.core.kv_disk import DiskTier, files_fingerprint, namespace_of
from tokenmill.engine.core.kv_host import HostTier
from tokenmill.engine.engine import Engine
from tokenmill.errors import ModelLoadError, TokenmillError
from tokenmill.kernels.cpu import cpu_info
from tokenmill.model.layers.kv_cache import block_nbytes
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import load_checkpoint, read_config
from tokenmill.model.ops import NativeOps
from tokenmill.model.paths import with_model_paths
from tokenmill.model.shard_plan import ModelShard, check_parallel_sizes
from tokenmill.model.tokenizer import Tokenizer, load_tokenizer
from tokenmill.speculative.draft import ModelProposer
from tokenmill.speculative.head_proposer import EagleProposer, MedusaProposer
from tokenmill.speculative.heads import HEADS, eagle_config, head_path, load_eagle, load_medusa, native_head_linears
from tokenmill.speculative.ngram import NgramProposer
from tokenmill.structured.grammar import GrammarCompiler
from tokenmill.worker.host_kv import HostKVBuffer
from tokenmill.worker.kv_allocation import allocate_kv_cache, block_bytes
from tokenmill.worker.lora import LoRAManager
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.model_setup import LoadPlan, load_shard, prepare_model, resolve_device
from tokenmill.worker.proposer import Proposer
from tokenmill.worker.speculation_pause import PayOrPause

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class EngineParts:
    """What build_engine made; ``LLM`` keeps it."""

    args: EngineArgs
    core: EngineCore
    engine: Engine | None  # the core with output processing; None for the engine-core process
    runner: ModelRunner
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    model_config: ModelConfig
    model_path: Path
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    num_blocks: int
    kv_bytes_per_block: int  # the target's cache and, with a draft model, the draft's

    def close(self) -> None:
        """The disk tier's queued blocks written, a split model's worker processes stopped."""
        self.core.close()
        self.runner.close()


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":  # bfloat16 where it is fast: GPUs, and CPUs that multiply it natively
        return torch.bfloat16 if device.type == "cuda" or cpu_info().native_bf16 else torch.float32
    if dtype not in DTYPES:
        raise TokenmillError(f"unsupported dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def kv_cache_sizing(
    args: EngineArgs, config: ModelConfig, dtype: torch.dtype, draft_config: ModelConfig | None = None
) -> tuple[int, int]:
    """(bytes per block, blocks the budget buys). A draft model's cache shares the
    target's block ids, so every block costs both."""
    cache = args.cache
    per_block = block_bytes(config, cache.block_size, dtype, cache.kv_cache_dtype)
    if draft_config is not None:
        per_block += block_bytes(draft_config, cache.block_size, dtype, cache.kv_cache_dtype)
    num_blocks = parse_memory(cache.kv_cache_memory) // per_block
    if num_blocks < 1:
        raise TokenmillError(f"kv_cache_memory={cache.kv_cache_memory!r} is smaller than one KV block")
    return per_block, num_blocks


def build_engine(args: EngineArgs, progress: bool = True, outputs: bool = True) -> EngineParts:
    """The model, its runner, an engine core over them, and (``outputs``) an ``Engine``
    around the core for one process; the engine-core process of ``tokenmill serve``
    asks for the core alone (its output processing is in the API process)."""
    args = with_model_paths(args)  # a Hub id: found in (or downloaded into) the Hub cache, once
    load, parallel = args.load, args.parallel
    device = resolve_device(load.device)
    dtype = resolve_dtype(load.dtype, device)
    check_options(args)  # before any weights load: a bad option costs no loading time
    plan = LoadPlan.decide(load, device, parallel.world_size)  # asked once, passed to every load
    ckpt = load_checkpoint(load.model, dtype, progress=progress, **plan.checkpoint_options())
    tokenizer = load_tokenizer(ckpt.path, ckpt.metadata)
    config, path = ckpt.config, ckpt.path
    cluster = None
    if parallel.world_size > 1:  # the other ranks start now and load their shards beside ours
        cluster = Cluster.launch(parallel.world_size)
    try:
        if cluster is None:
            model = prepare_model(LlamaForCausalLM.from_weights(config, ckpt.weights, device), device, load, plan)
            shard, local = ModelShard(), config
        else:
            if device.type == "cpu":
                cluster.share_cores(threads_per_rank(cluster.local_world_size))
            cluster.connect()
            cluster.broadcast(Load(args, str(dtype).removeprefix("torch.")))
            shard = ModelShard(0, parallel.tensor_parallel_size, 0, parallel.pipeline_parallel_size)
            device = rank_device(device, 0)
            model = load_shard(config, ckpt.weights, shard, load, device, plan)
            local = shard.local_config(config)
        del ckpt
        max_model_len = min(load.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        spec = args.speculative
        draft = (
            _load_draft(spec.draft_model, config, tokenizer, args, dtype, device, plan, progress)
            if spec and spec.method == "draft"
            else None
        )
        head = head_path(spec.method, spec.draft_model, args.load.model) if spec and spec.method in HEADS else None
        head_layer = eagle_config(head, config)[0].layer if spec and spec.method == "eagle" and head else None
        per_block, num_blocks = kv_cache_sizing(args, local, dtype, draft.config if draft is not None else head_layer)
        pool_tokens = num_blocks * args.cache.block_size
        if max_model_len > pool_tokens:  # a longer request could never finish: refuse it up front instead
            logger.warning(
                "max_model_len %d is more than the KV cache holds (%d blocks of %d = %d tokens): "
                "using %d; raise kv_cache_memory for longer contexts",
                max_model_len,
                num_blocks,
                args.cache.block_size,
                pool_tokens,
                pool_tokens,
            )
            max_model_len = pool_tokens
        cache = args.cache
        kv_caches = allocate_kv_cache(local, num_blocks, cache.block_size, dtype, device, cache.kv_cache_dtype)
        proposer = _proposer(spec, model, draft, head, kv_caches, num_blocks, args, dtype, device) if spec else None
        if args.lora.enable_lora and config.num_experts:
            raise TokenmillError("LoRA adapters on a mixture-of-experts model are not supported yet")
        lora = LoRAManager(model, args.lora) if args.lora.enable_lora else None
        pause = PayOrPause() if spec is not None and spec.spec_auto_pause else None
        if cluster is None:
            runner = ModelRunner(model, kv_caches, cache.block_size, device, proposer, lora, pause=pause)
        else:
            cluster.broadcast(Setup(num_blocks))
            stage = parallel_stage(cluster.groups(shard, device), model, kv_caches, cache.block_size, device, config)
            runner = DistributedRunner(
                model, kv_caches, cache.block_size, device, proposer, stage=stage, cluster=cluster, pause=pause
            )
    except BaseException:
        if cluster is not None:
            cluster.shutdown()
        raise
    core = EngineCore(
        runner,
        tokenizer,
        EngineConfig(
            num_blocks=num_blocks,
            block_size=cache.block_size,
            max_model_len=max_model_len,
            enable_prefix_caching=cache.enable_prefix_caching,
            scheduler=args.scheduler,
            speculative=spec,
            max_loras=args.lora.max_loras if args.lora.enable_lora else None,
            sliding_window=config.sliding_window,
        ),
        grammars=_grammar_compiler(tokenizer, config.vocab_size, args.structured),
        disk_tier=_disk_tier(args, path, dtype, kv_caches, runner, proposer) if cache.kv_disk_cache else None,
        host_tier=_host_tier(args, device, kv_caches, runner, proposer) if cache.kv_host_cache is not None else None,
    )
    for name, lora_path in args.lora.modules.items():
        core.add_lora(name, lora_path)
    engine = Engine(core, tokenizer) if outputs else None
    return EngineParts(
        args, core, engine, runner, model, tokenizer, config, path, device, dtype, max_model_len, num_blocks, per_block
    )


def _disk_tier(
    args: EngineArgs, path: Path, dtype: torch.dtype, kv_caches: list, runner: ModelRunner, proposer: Proposer | None
) -> DiskTier:
    """The prefix cache's disk tier, its namespace everything that decides a block's numbers: the
    model's files, the dtypes, the block size, the quantised arithmetic and kernels, this CPU and
    this torch (blocks computed elsewhere would differ in their last bits from a recompute)."""
    cache, load = args.cache, args.load
    _check_tier("kv_disk_cache", args, runner, proposer)
    facts = {
        "model": str(path.resolve()),
        "files": files_fingerprint(path).hex(),
        "dtype": str(dtype),
        "kv_cache_dtype": cache.kv_cache_dtype,
        "block_size": cache.block_size,
        "block_bytes": block_nbytes(kv_caches),
        "quantization": load.quantization,
        "quant_arithmetic": load.quant_arithmetic,
        "kernels": load.kernels,
        "cpu": cpu_info().describe(),
        "torch": torch.__version__,
    }
    size = parse_memory(cache.kv_disk_cache_size)
    if size <= 0:
        raise TokenmillError(f"kv_disk_cache_size must be above 0 bytes, got {cache.kv_disk_cache_size!r}")
    return DiskTier(cache.kv_disk_cache, namespace_of(facts), size)


def _host_tier(
    args: EngineArgs, device: torch.device, kv_caches: list, runner: ModelRunner, proposer: Proposer | None
) -> HostTier:
    """The prefix cache's host-memory tier: its bookkeeping for the engine, its buffer of whole
    blocks (pinned for a CUDA pool) for the runner."""
    _check_tier("kv_host_cache", args, runner, proposer)
    size, row = parse_memory(args.cache.kv_host_cache), block_nbytes(kv_caches)
    if size < row:
        raise TokenmillError(
            f"kv_host_cache must hold one KV block at least ({row} bytes), got {args.cache.kv_host_cache!r}"
        )
    if device.type == "cpu":
        logger.warning(
            "kv_host_cache on a CPU copies blocks from host memory to host memory: a larger kv_cache_memory "
            "would hold them in the pool itself"
        )
    runner.host_kv = HostKVBuffer(size // row, kv_caches, pin=device.type == "cuda")
    return HostTier(size // row, row)


def _check_tier(name: str, args: EngineArgs, runner: ModelRunner, proposer: Proposer | None) -> None:
    """A tier below the pool stores and reads the runner's blocks: one process, the target's own K/V."""
    if not args.cache.enable_prefix_caching:
        raise TokenmillError(f"{name} is a tier of the prefix cache: it needs prefix caching on")
    if type(runner) is not ModelRunner:
        raise TokenmillError(f"{name} needs the model in one process (no tensor or pipeline parallelism)")
    if proposer is not None and getattr(proposer, "catch_up", False):
        raise TokenmillError(f"{name} cannot follow a draft model's own KV cache (speculative method draft)")


def _grammar_compiler(tokenizer: Tokenizer, vocab_size: int, config: StructuredConfig) -> GrammarCompiler | None:
    """Structured output's compiler, for a vocabulary as wide as the logits; None (and
    structured requests refused with the reason) where llguidance is not installed."""
    if importlib.util.find_spec("llguidance") is None:
        logger.warning("llguidance is not installed: structured output and tool calling are unavailable")
        return None
    return GrammarCompiler(tokenizer, vocab_size, config)


def check_options(args: EngineArgs) -> None:
    """Check the options against the checkpoints' headers (config.json, a GGUF's
    metadata), before any weights load: a draft that does not share the target's
    vocabulary, self-speculation deeper than the model, sizes that do not split it."""
    spec = args.speculative
    if (spec is None or spec.method == "ngram") and args.parallel.world_size == 1:
        return  # nothing depends on the checkpoint: its header is read once, by the loader
    path, config = read_config(args.load.model)
    if spec is not None and spec.method == "self" and spec.draft_layers is not None:
        if spec.draft_layers >= config.num_layers:
            raise TokenmillError(
                f"draft_layers={spec.draft_layers} must be below the model's {config.num_layers} layers"
            )
    if spec is not None and spec.method in HEADS:
        head = head_path(spec.method, spec.draft_model, args.load.model)
        if not head.is_dir():
            raise TokenmillError(f"{spec.method} head {head} is not a folder (config.json and the head's weights)")
        if spec.method == "eagle":
            eagle_config(head, config)
    if spec is not None and spec.method == "draft":
        draft_path, draft = read_config(spec.draft_model)
        if draft.vocab_size != config.vocab_size:
            raise TokenmillError(
                f"draft model {spec.draft_model} has a vocabulary of {draft.vocab_size} tokens but the target's has "
                f"{config.vocab_size}: a draft must share the target's tokenizer"
            )
        try:
            draft_tokenizer = load_tokenizer(draft_path)
        except ModelLoadError:
            draft_tokenizer = None  # weights only: the vocabulary size has to do
        if (
            draft_tokenizer is not None
            and draft_tokenizer.backend.get_vocab() != load_tokenizer(path).backend.get_vocab()
        ):
            raise TokenmillError(
                f"draft model {spec.draft_model} has a different tokenizer vocabulary from the target's"
            )
    if args.parallel.world_size > 1:
        check_parallel_options(args, config)


def _load_draft(
    path: str | None,
    target: ModelConfig,
    tokenizer: Tokenizer,
    args: EngineArgs,
    dtype: torch.dtype,
    device: torch.device,
    plan: LoadPlan,
    progress: bool,
) -> LlamaForCausalLM:
    """Load the draft model (checked against the target by ``check_options``)."""
    ckpt = load_checkpoint(path, dtype, progress=progress, **plan.checkpoint_options())
    return prepare_model(LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights, device), device, args.load, plan)


def _proposer(
    spec: SpeculativeConfig,
    model: LlamaForCausalLM,
    draft: LlamaForCausalLM | None,
    head: Path | None,
    kv_caches: list,
    num_blocks: int,
    args: EngineArgs,
    dtype: torch.dtype,
    device: torch.device,
) -> Proposer:
    block_size = args.cache.block_size
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
    if spec.spec_tree_width > 1 and any(model.config.window_of(i) for i in range(model.config.num_layers)):
        raise TokenmillError("draft trees (spec_tree_width > 1) are not supported on sliding-window models yet")
    if spec.method == "eagle":
        assert head is not None
        eagle = load_eagle(head, model)
        if isinstance(model.ops, NativeOps):
            native_head_linears(eagle)
        cache = allocate_kv_cache(eagle.config.layer, num_blocks, block_size, dtype, device, args.cache.kv_cache_dtype)
        return EagleProposer(model, eagle, cache[0], block_size, device, spec.draft_confidence, spec.spec_tree_width)
    if spec.method == "medusa":
        assert head is not None
        return MedusaProposer(model, load_medusa(head, model), spec.draft_confidence, spec.spec_tree_width)
    if spec.method == "self":
        assert spec.draft_layers is not None  # below the model's layers: check_options
        return ModelProposer(model, kv_caches, block_size, device, spec.draft_layers, catch_up=False)
    assert draft is not None
    draft_caches = allocate_kv_cache(draft.config, num_blocks, block_size, dtype, device, args.cache.kv_cache_dtype)
    return ModelProposer(draft, draft_caches, block_size, device)


# ------------------------------------------------------------ tensor / pipeline parallel


def check_parallel_options(args: EngineArgs, config: ModelConfig) -> None:
    """Refuse what a split model cannot do (yet), and sizes that do not split this model."""
    parallel, spec = args.parallel, args.speculative
    if args.lora.enable_lora:
        raise TokenmillError("LoRA adapters are not supported with tensor or pipeline parallelism yet")
    if spec is not None and spec.method != "ngram":
        raise TokenmillError(
            f"speculative method {spec.method!r} is not supported with tensor or pipeline "
            "parallelism yet (prompt lookup, 'ngram', is)"
        )
    check_parallel_sizes(config, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
