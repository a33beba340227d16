"""Frozen configuration dataclasses, one per concern; every default written once.

``ModelConfig`` is the architecture read from a checkpoint. The options a user sets
are ``LoadConfig`` (which model, how), ``CacheConfig`` (the KV pool),
``SchedulerConfig`` (the step budget), ``SpeculativeConfig`` (drafting), ``LoRAConfig``
(adapters) and ``ParallelConfig`` (tensor / pipeline parallelism); ``EngineArgs``
groups the engine's. The server's and the replicas' are in ``configuration/serving_config.py``. Each field's
metadata holds its help text (and its flag name where that differs), so the CLI
flags and the ``LLM`` keywords are generated from these classes (``tokenmill.configuration.args``):
a new option is one new field. Derived values are properties or computed once by
the factory; nothing is mutated after construction.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import InvalidRequestError


def opt(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    negative: str | None = None,
    repeat: bool = False,
    check: Callable[[Any], Any] | None = None,
) -> Any:
    """A config field: its default, help text, and (optionally) the keyword/flag name
    when it differs from the field's, its choices, for a boolean that defaults to True
    the name of the flag that turns it off, for a tuple whether its flag is given
    once per value (``--api-key A --api-key B``) rather than once with several, and the
    check of its value (``tokenmill.configuration.flag_types``): its flag's type, and what the class's
    ``check_fields`` runs."""
    meta = {"help": help, "flag": flag, "choices": choices, "negative": negative, "repeat": repeat, "check": check}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as Hugging Face's `rope_scaling` describes it."""

    rope_type: str = "default"  # default | linear | llama3 | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3): per-frequency divisors below / from the original context, and the
    # factor cos and sin are multiplied by
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder of the Llama family (Llama, Mistral, Qwen2, Qwen3: one decoder,
    a few switches); filled from GGUF metadata or config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    architecture: str = "llama"
    attention_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # a query sees only the last this-many positions (Mistral)
    num_experts: int = 0  # mixture of experts (Mixtral): experts per layer (0: a dense MLP)
    num_experts_per_tok: int = 0  # experts each token is routed to
    # Gemma 2/3
    hidden_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    embedding_scale: float | None = None  # token embeddings multiplied by this (sqrt(hidden))
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too, and a pre-MLP norm
    attn_softcap: float | None = None  # attention scores through cap * tanh(s / cap)
    final_softcap: float | None = None  # logits likewise
    query_scale: float | None = None  # attention scale (default: head_dim ** -0.5)
    layer_windows: tuple[int | None, ...] | None = None  # per-layer sliding windows (None: full)
    rope_local_theta: float | None = None  # RoPE base of the windowed layers, when it differs

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows is not None else self.sliding_window

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V stored per token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


SPECULATIVE_METHODS = ("ngram", "draft", "self", "eagle", "medusa")
WEIGHT_QUANTIZATIONS = ("auto", "none", "int8", "int4")
KERNELS = ("auto", "native", "torch")
QUANT_ARITHMETICS = ("float", "int8")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class LoadConfig:
    """Which model to load, in what precision, on which device."""

    model: str | None = opt(
        None,
        "a .gguf file, a Hugging Face folder, or a Hub repo id (ORG/NAME, or ORG/NAME:QUANT for a GGUF repo; "
        "downloaded into the Hub cache once) (default: the bundled SmolLM2-135M-Instruct Q4_1)",
    )
    revision: str | None = opt(None, "a Hub repo id's branch, tag or commit (default: main)")
    dtype: str = opt(
        "auto",
        "auto, float32, bfloat16 or float16 (auto: bfloat16 on CUDA and on CPUs with native "
        "bfloat16 (AVX512_BF16 or AMX), float32 on other CPUs)",
    )
    device: str = opt("cpu", "cpu, cuda, cuda:N or auto")
    max_model_len: int | None = opt(None, "context window (default: the model's)")
    quantization: str = opt(
        "auto",
        "weights: auto (a GGUF's quantised tensors served as they are stored, with the "
        "native kernels; otherwise none), none (dequantised to dtype), or int8 / int4 "
        "(quantised at load)",
        choices=WEIGHT_QUANTIZATIONS,
    )
    quantization_group_size: int = opt(32, "int4: input channels per scale and zero point (GGUF Q4 blocks are 32)")
    quant_arithmetic: str = opt(
        "int8",
        "a GGUF's quantised weights, kept by quantization auto: int8 "
        "(Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K kept at the file's own bytes, activations "
        "quantised to 8-bit blocks per step and integer dot products: llama.cpp's "
        "arithmetic and perplexity) or float (widened at load to float-scaled "
        "groups, multiplied in float: the dequantised weights' numbers, the "
        "reference)",
        choices=QUANT_ARITHMETICS,
    )
    kernels: str = opt(
        "auto",
        "per-layer ops: native (C++ CPU kernels, built on first use), torch (the pure-torch "
        "reference) or auto (native on the CPU where they build)",
        choices=KERNELS,
    )

    def __post_init__(self) -> None:
        require(
            self.quantization in WEIGHT_QUANTIZATIONS,
            f"quantization must be one of {', '.join(WEIGHT_QUANTIZATIONS)}, got {self.quantization!r}",
        )
        require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
        require(self.quantization_group_size >= 1, "quantization_group_size must be >= 1")
        require(
            self.quant_arithmetic in QUANT_ARITHMETICS,
            f"quant_arithmetic must be one of {', '.join(QUANT_ARITHMETICS)}, got {self.quant_arithmetic!r}",
        )
        require(self.kernels in KERNELS, f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, pool size, storage type, prefix reuse."""

    block_size: int = opt(16, "tokens per KV-cache block")
    kv_cache_memory: int | float | str | None = opt(
        None, "KV cache size: bytes, or with a unit such as 1GiB, 512MiB (default: 10%% of free RAM, 256 MiB..2 GiB)"
    )
    kv_cache_dtype: str = opt(
        "auto", "how K and V are stored (int8/fp8: quantised, per-token scales)", choices=KV_CACHE_DTYPES
    )
    enable_prefix_caching: bool = opt(True, "turn off reuse of cached prompt blocks", negative="no-prefix-caching")
    kv_disk_cache: str | None = opt(
        None,
        "a directory for the prefix cache's disk tier: full KV blocks written there as they are "
        "computed (by a thread), read back on a prefix-cache miss, kept over restarts; files are "
        "keyed by model files, dtypes and kernels, and a corrupt one is a miss (default: none)",
    )
    kv_disk_cache_size: int | float | str = opt(
        "4GiB", "the most the disk tier keeps, e.g. 4GiB, 512MiB (least recently used blocks removed past it)"
    )
    kv_host_cache: int | float | str | None = opt(
        None,
        "a tier of the prefix cache in host memory, its size (e.g. 8GiB): full KV blocks copied there "
        "as they are computed, read back on a miss before the disk tier; for an accelerator's pool "
        "(on a CPU the pool is host memory: a larger kv_cache_memory serves better) (default: none)",
    )

    def __post_init__(self) -> None:
        require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """The step budget and the batching policy."""

    max_num_seqs: int = opt(64, "most sequences in one step")
    max_num_batched_tokens: int = opt(512, "token budget of one step (longer prompts are chunked)")
    scheduling: str = opt(
        "continuous", "continuous batching, or the static-batching baseline", choices=("continuous", "static")
    )
    scheduling_policy: str = opt(
        "fcfs",
        "which waiting request goes first: fcfs (arrival order), or priority (a request's `priority`, lower "
        "first, then arrival, as vLLM's; preemption takes the running request that comes last by the same order; "
        "aged by priority_aging_steps)",
        choices=("fcfs", "priority"),
    )
    priority_aging_steps: int = opt(
        100,
        "scheduling_policy priority: a request that arrived this many steps ago goes ahead of every "
        "request that arrived since, whatever their priorities (oldest first), and is preempted only "
        "after them: priority orders the queue but cannot starve it",
    )

    def __post_init__(self) -> None:
        require(
            self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 1,
            "max_num_seqs and max_num_batched_tokens must be >= 1",
        )
        require(self.priority_aging_steps >= 1, f"priority_aging_steps must be >= 1, got {self.priority_aging_steps}")
        require(
            self.scheduling in ("continuous", "static"),
            f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}",
        )
        require(
            self.scheduling_policy in ("fcfs", "priority"),
            f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}",
        )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes, how many tokens, and when to stop bothering.

    ``method``: "ngram" (prompt lookup, no model), "draft" (a smaller model with the
    same vocabulary), "self" (the target's first ``draft_layers`` layers and its LM
    head), "eagle" or "medusa" (a head over the target's hidden states, ``draft_model``
    its folder; the default model's EAGLE head ships with the package). Above ``disable_batch_size`` running requests decode is no longer
    memory-bound enough for verification to pay, and speculation pauses (the default
    4 is measured: bench/speculative.py).
    """

    method: str = opt(
        "ngram",
        "who drafts tokens for the target to verify: prompt lookup (ngram), a draft model, "
        "the target's own first layers (self), or a head over its hidden states (eagle, medusa)",
        flag="speculative",
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = opt(4, "tokens drafted per step (k)")
    prompt_lookup_max: int = opt(4, "ngram: longest suffix to look up")
    prompt_lookup_min: int = opt(1, "ngram: shortest suffix to look up")
    draft_model: str | None = opt(
        None, "draft model (.gguf or folder) with the target's vocabulary, or an EAGLE / Medusa head's folder"
    )
    draft_layers: int | None = opt(None, "self-speculation: layers the draft runs")
    spec_tree_width: int = opt(
        1,
        "eagle / medusa: candidates per draft position for greedy requests, verified as "
        "one tree of num_speculative_tokens nodes (1: a chain)",
    )
    spec_auto_pause: bool = opt(
        True, "keep drafting only while it measurably speeds decoding up on this machine", negative="no-spec-auto-pause"
    )
    draft_confidence: float = opt(
        0.5,
        "eagle / medusa: draft only while the head's probability of all its drafts so "
        "far stays at or above this (0: always k tokens; 0.5 measured best on CPUs, "
        "bench/RESULTS.md)",
    )
    disable_batch_size: int = opt(
        4, "pause speculation above this many running requests", flag="spec_disable_batch_size"
    )

    def __post_init__(self) -> None:
        require(
            self.method in SPECULATIVE_METHODS,
            f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}",
        )
        require(
            self.num_speculative_tokens >= 1, f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
        )
        require(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max, "need 1 <= prompt_lookup_min <= prompt_lookup_max"
        )
        require(
            self.method not in ("draft", "medusa") or bool(self.draft_model),
            f"speculative method {self.method!r} needs a draft model (--draft-model)",
        )
        require(
            self.method != "self" or (self.draft_layers is not None and self.draft_layers >= 1),
            "speculative method 'self' needs draft_layers >= 1 (--draft-layers)",
        )
        require(self.disable_batch_size >= 1, "spec_disable_batch_size must be >= 1")
        require(self.spec_tree_width >= 1, f"spec_tree_width must be >= 1, got {self.spec_tree_width}")
        require(
            self.spec_tree_width == 1 or self.method in ("eagle", "medusa"),
            "spec_tree_width > 1 (a draft tree) needs speculative 'eagle' or 'medusa'",
        )
        require(0.0 <= self.draft_confidence < 1.0, f"draft_confidence must be in [0, 1), got {self.draft_confidence}")

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a model-based proposer writes past the verified tokens while drafting."""
        return 0 if self.method in ("ngram", "medusa") else self.num_speculative_tokens


ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_adapter_name(name: str) -> None:
    """Adapter names are model ids clients send and logs print: letters, digits, '.',
    '_' and '-', a letter or digit first, at most 128 (no path, control or bidi mark)."""
    if not isinstance(name, str) or ADAPTER_NAME.fullmatch(name) is None:
        raise InvalidRequestError(
            "a LoRA adapter name is 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit",
            param="lora_name",
        )


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving: adapters on one base model, mixed in one batch."""

    enable_lora: bool = opt(False, "serve LoRA adapters (PEFT folders) on top of the base model")
    lora_modules: tuple[str, ...] = opt((), "adapters to serve, as name=path (repeatable: name=path name2=path2)")
    max_loras: int = opt(4, "most distinct adapters in one step (slots of adapter weights beside the model)")
    max_lora_rank: int = opt(16, "largest adapter rank accepted (slots are this wide)")
    max_cpu_loras: int | None = opt(
        None, "adapters kept loaded in memory, least recently used evicted beyond (default: max_loras)"
    )
    lora_root: str | None = opt(
        None, "load adapters only from folders inside this one (symlinks followed); other paths are refused"
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules or ()))
        require(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        require(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        require(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})",
        )
        for m in self.lora_modules:
            require(
                "=" in m and m.split("=", 1)[0] and m.split("=", 1)[1], f"lora_modules entries are name=path, got {m!r}"
            )
            check_adapter_name(m.split("=", 1)[0])
        require(self.enable_lora or not self.lora_modules, "lora_modules needs enable_lora (--enable-lora)")
        require(self.enable_lora or self.lora_root is None, "lora_root needs enable_lora (--enable-lora)")

    @property
    def modules(self) -> dict[str, str]:
        return dict(m.split("=", 1) for m in self.lora_modules)

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


@dataclass(frozen=True)
class StructuredConfig:
    """What one request's structured output (a JSON schema, regex, choice or grammar, or
    the tools it offers) may cost. Past either limit the request gets a 400 before it
    is queued, so that a few heavy grammars cannot starve everyone else."""

    max_grammar_bytes: int = opt(
        256 << 10,
        "largest structured output accepted (a JSON schema, regex or grammar, or the choices together), in bytes",
    )
    grammar_compile_timeout: float = opt(10.0, "seconds a request's grammar may wait for and take to compile")

    def __post_init__(self) -> None:
        require(self.max_grammar_bytes >= 1, f"max_grammar_bytes must be >= 1, got {self.max_grammar_bytes}")
        require(
            self.grammar_compile_timeout > 0, f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}"
        )


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor and pipeline parallelism: the model split across processes (gloo on the CPU,
    NCCL on GPUs). On one machine the engine starts its worker processes itself; across
    machines every rank runs under ``torchrun`` (README: "Several processes or machines")."""

    tensor_parallel_size: int = opt(
        1,
        "ranks each layer's matrices are split across (attention heads, MLP "
        "columns, vocabulary); must divide the query heads",
    )
    pipeline_parallel_size: int = opt(1, "pipeline stages the layers are split into; must divide the layers")

    def __post_init__(self) -> None:
        require(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        require(
            self.pipeline_parallel_size >= 1, f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}"
        )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class EngineArgs:
    """Everything that builds an engine: one frozen config per concern."""

    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    structured: StructuredConfig = field(default_factory=StructuredConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
