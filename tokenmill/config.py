"""Frozen configuration dataclasses, one per concern; every default written once.

``ModelConfig`` is the architecture read from a checkpoint. The options a user sets
are ``LoadConfig`` (which model, how), ``CacheConfig`` (the KV pool),
``SchedulerConfig`` (the step budget), ``SpeculativeConfig`` (drafting), ``LoRAConfig``
(adapters), ``ParallelConfig`` (tensor / pipeline parallelism) and ``ServerConfig``
(HTTP); ``EngineArgs`` groups the engine's. Each field's
metadata holds its help text (and its flag name where that differs), so the CLI
flags and the ``LLM`` keywords are generated from these classes (``tokenmill.args``):
a new option is one new field. Derived values are properties or computed once by
the factory; nothing is mutated after construction.
"""

from __future__ import annotations

import re
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
) -> Any:
    """A config field: its default, help text, and (optionally) the keyword/flag name
    when it differs from the field's, its choices, for a boolean that defaults to True
    the name of the flag that turns it off, and for a tuple whether its flag is given
    once per value (``--api-key A --api-key B``) rather than once with several."""
    meta = {"help": help, "flag": flag, "choices": choices, "negative": negative, "repeat": repeat}
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


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class LoadConfig:
    """Which model to load, in what precision, on which device."""

    model: str | None = opt(
        None, "a .gguf file or a Hugging Face folder (default: the bundled SmolLM2-135M-Instruct Q4_1)"
    )
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
        "(Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K kept at the file's own bytes, activations "
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
        _check(
            self.quantization in WEIGHT_QUANTIZATIONS,
            f"quantization must be one of {', '.join(WEIGHT_QUANTIZATIONS)}, got {self.quantization!r}",
        )
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
        _check(self.quantization_group_size >= 1, "quantization_group_size must be >= 1")
        _check(
            self.quant_arithmetic in QUANT_ARITHMETICS,
            f"quant_arithmetic must be one of {', '.join(QUANT_ARITHMETICS)}, got {self.quant_arithmetic!r}",
        )
        _check(self.kernels in KERNELS, f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")


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

    def __post_init__(self) -> None:
        _check(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _check(
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
        "first, then arrival, as vLLM's; preemption takes the running request that comes last by the same order)",
        choices=("fcfs", "priority"),
    )

    def __post_init__(self) -> None:
        _check(
            self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 1,
            "max_num_seqs and max_num_batched_tokens must be >= 1",
        )
        _check(
            self.scheduling in ("continuous", "static"),
            f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}",
        )
        _check(
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
        _check(
            self.method in SPECULATIVE_METHODS,
            f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}",
        )
        _check(
            self.num_speculative_tokens >= 1, f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
        )
        _check(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max, "need 1 <= prompt_lookup_min <= prompt_lookup_max"
        )
        _check(
            self.method not in ("draft", "medusa") or bool(self.draft_model),
            f"speculative method {self.method!r} needs a draft model (--draft-model)",
        )
        _check(
            self.method != "self" or (self.draft_layers is not None and self.draft_layers >= 1),
            "speculative method 'self' needs draft_layers >= 1 (--draft-layers)",
        )
        _check(self.disable_batch_size >= 1, "spec_disable_batch_size must be >= 1")
        _check(self.spec_tree_width >= 1, f"spec_tree_width must be >= 1, got {self.spec_tree_width}")
        _check(
            self.spec_tree_width == 1 or self.method in ("eagle", "medusa"),
            "spec_tree_width > 1 (a draft tree) needs speculative 'eagle' or 'medusa'",
        )
        _check(0.0 <= self.draft_confidence < 1.0, f"draft_confidence must be in [0, 1), got {self.draft_confidence}")

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
        _check(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        _check(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        _check(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})",
        )
        for m in self.lora_modules:
            _check(
                "=" in m and m.split("=", 1)[0] and m.split("=", 1)[1], f"lora_modules entries are name=path, got {m!r}"
            )
            check_adapter_name(m.split("=", 1)[0])
        _check(self.enable_lora or not self.lora_modules, "lora_modules needs enable_lora (--enable-lora)")
        _check(self.enable_lora or self.lora_root is None, "lora_root needs enable_lora (--enable-lora)")

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
        _check(self.max_grammar_bytes >= 1, f"max_grammar_bytes must be >= 1, got {self.max_grammar_bytes}")
        _check(
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
        _check(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        _check(
            self.pipeline_parallel_size >= 1, f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}"
        )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


RESPONSE_CACHES = ("off", "exact", "semantic")
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # server/reasoning.py


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server."""

    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(8000, "port to listen on")
    api_key: tuple[str, ...] = opt(
        (),
        "require 'Authorization: Bearer KEY' on /v1 routes; give it once per key: "
        "each key is a tenant of its own (the response cache never crosses them)",
        repeat=True,
    )
    api_key_file: str | None = opt(
        None, "a file of API keys, one per line (blank lines and # comments skipped), added to --api-key's"
    )
    max_queue: int | None = opt(
        1024,
        "answer 429 (with Retry-After) while this many engine sequences wait for a place in the batch; 0: no limit",
    )
    max_prompts_per_request: int = opt(2048, "most prompts in one completions request; more get 400")
    max_embedding_inputs: int = opt(2048, "most texts in one embeddings, pooling, score or rerank request; more: 400")
    max_request_tokens: int = opt(
        262144, "most prompt tokens in one request, all its prompts or inputs together; more get 400"
    )
    max_inflight_prompts_per_client: int = opt(
        32,
        "fairness: the prompts of a request that has several enter the "
        "engine at most this many at a time per client (API key, else "
        "address), so that other clients' requests share the steps",
    )
    drain_timeout: float = opt(30.0, "seconds SIGTERM waits for in-flight requests")
    served_model_name: str | None = opt(None, "the model id clients send (default: the model's file name)")
    max_request_bytes: int = opt(2 << 20, "largest request body accepted; larger ones get 413")
    request_body_timeout: float = opt(30.0, "seconds a client has to send a request's whole body; then 408")
    max_open_requests: int = opt(
        1024,
        "most HTTP requests open at once (bodies still arriving and streams "
        "included); more get 503 until some finish (/health and /metrics exempt)",
    )
    max_connections_per_client: int = opt(
        256,
        "most connections open at once from one client address (an IPv6 "
        "address: its /64); more are answered 429 and closed",
    )
    max_unfinished_bodies_per_client: int = opt(
        128, "most requests from one client address whose bodies are still arriving; more get 429"
    )
    request_header_timeout: float = opt(
        5.0,
        "seconds a connection has to send a whole request head, from its start or its last response; then it is closed",
    )
    allow_runtime_lora_updating: bool = opt(False, "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    trust_request_chat_template: bool = opt(
        False,
        "let a chat request bring its own Jinja template (vLLM's chat_template field; rendered in a "
        "sandbox, but a client's template can still cost the server time): refused with 400 by default",
    )
    allow_special_tokens_in_messages: bool = opt(
        False,
        "tokenise special-token text in chat messages (and tools) as "
        "special tokens, as the rendered prompt reads: a client can then "
        "end its turn and forge a system one (default: as plain text; "
        "the template's own markers stay special)",
    )
    reasoning_parser: str | None = opt(
        None,
        "reasoning models, as vLLM's: split a chat answer's <think>...</think> into "
        "reasoning_content (a response's reasoning item), the rest into content; tool calls "
        "and structured output apply after it. qwen3 (no reasoning with "
        "chat_template_kwargs enable_thinking false) or deepseek_r1; for each served model "
        "whose vocabulary has the <think> and </think> tokens",
        choices=REASONING_PARSERS,
    )
    max_stored_responses: int = opt(
        1000, "responses kept for previous_response_id and GET /v1/responses/{id} (store: true; the oldest go first)"
    )
    stored_response_ttl: float = opt(3600.0, "seconds a stored response is kept")
    engine_core: str = opt(
        "process",
        "where the engine loop runs: process (its own, beside the API process that "
        "tokenises, detokenises and streams) or thread (a thread of the API process)",
        choices=("process", "thread"),
    )
    response_cache: str = opt(
        "off",
        "answer repeated requests from memory, per API key: off; exact (the same "
        "request, whose answer is reproducible: temperature 0 or a seed); semantic (exact, "
        "and a greedy chat whose last user message is close enough to a cached one's)",
        choices=RESPONSE_CACHES,
    )
    response_cache_memory: str = opt("256MiB", "the response cache's size; the least recently used answers go first")
    response_cache_ttl: float = opt(3600.0, "seconds a cached answer is served")
    semantic_cache_threshold: float = opt(
        0.9995,
        "--response-cache semantic: the cosine similarity of the last user "
        "messages' embeddings from which a cached answer is served (the "
        "default admits no false hit on bench/semantic_pairs.json with the "
        "default model's own embeddings: see bench/RESULTS.md)",
    )
    semantic_cache_model: str | None = opt(
        None,
        "--response-cache semantic: the served model whose embeddings compare "
        "last user messages (an embedding model served beside the others, "
        "NAME=PATH); default: the model the request names (a router's: its "
        "small model)",
    )
    semantic_cache_pooling: str = opt(
        "last",
        "--response-cache semantic: the embedding of a message: the final hidden "
        "state at its last token (as decoder embedding models), or the mean",
        choices=("last", "mean"),
    )
    router: tuple[str, ...] = opt(
        (),
        "NAME=SMALL,LARGE: a virtual model that sends each request to the small or "
        "the large of two served models (give it once per router)",
        repeat=True,
    )
    router_threshold: float = opt(
        0.5,
        "routers: the small model's answer is kept when its confidence (the geometric "
        "mean of its tokens' probabilities) is at least this; else the large answers",
    )
    router_max_prompt_tokens: int | None = opt(None, "routers: prompts longer than this go straight to the large model")
    router_large_for: tuple[str, ...] = opt(
        ("tools", "response_format"),
        "routers: requests with these go straight "
        "to the large model (of tools, response_format, logprobs; none: no such rule)",
    )
    router_classifier: str | None = opt(
        None,
        "routers: MODULE:FUNCTION called with each request's body (a dict); it "
        "returns 'small', 'large' or None (no opinion: the other rules decide)",
    )
    web: bool = opt(
        True,
        "serve the web page at GET / (chat playground and live engine view; behind --api-key like the API)",
        negative="no-web",
    )
    web_session_ttl: float = opt(
        43200.0, "with --api-key: seconds a sign-in to the web page lasts (then it asks for the key again)"
    )

    def __post_init__(self) -> None:
        if isinstance(self.api_key, str):  # one key, as a keyword
            object.__setattr__(self, "api_key", (self.api_key,))
        _check(
            self.response_cache in RESPONSE_CACHES,
            f"response_cache must be one of {', '.join(RESPONSE_CACHES)}, got {self.response_cache!r}",
        )
        _check(self.response_cache_ttl > 0, f"response_cache_ttl must be > 0, got {self.response_cache_ttl}")
        _check(
            self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
            f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}",
        )
        for name in (
            "max_prompts_per_request",
            "max_embedding_inputs",
            "max_request_tokens",
            "max_inflight_prompts_per_client",
        ):
            _check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _check(self.max_queue is None or self.max_queue >= 0, f"max_queue must be >= 0, got {self.max_queue}")
        _check(
            0 < self.semantic_cache_threshold <= 1,
            f"semantic_cache_threshold must be in (0, 1], got {self.semantic_cache_threshold}",
        )
        _check(0 <= self.router_threshold <= 1, f"router_threshold must be in [0, 1], got {self.router_threshold}")
        _check(
            self.router_max_prompt_tokens is None or self.router_max_prompt_tokens >= 1,
            "router_max_prompt_tokens must be >= 1",
        )
        unknown = sorted(set(self.router_large_for) - {"tools", "response_format", "logprobs", "none"})
        _check(
            not unknown, f"router_large_for takes tools, response_format, logprobs or none, not {', '.join(unknown)}"
        )
        for name in ("max_connections_per_client", "max_unfinished_bodies_per_client"):
            _check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_header_timeout", "web_session_ttl"):
            _check(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ReplicaConfig:
    """Engine replicas behind one server, on Ray Serve (``pip install tokenmill[ray]``):
    data-parallel copies with a router, or prefill and decode pools. The Ray cluster is
    the one ``RAY_ADDRESS`` names, else a local one started for the server."""

    data_parallel_size: int = opt(1, "engine replicas behind this server, each with its own KV cache (Ray Serve)")
    ray: bool = opt(False, "run the engine as a Ray Serve replica even when there is one (implied by more)")
    routing: str = opt(
        "kv",
        "which replica serves a request: kv (the one whose cache leaves the fewest prompt "
        "tokens to compute, weighed against its load), pow2 (less loaded of two at random), round-robin",
        choices=("kv", "pow2", "round-robin"),
    )
    route_load_cost: int | str = opt(
        "auto",
        "kv routing's price of a request in flight on a replica, in prompt tokens "
        "(weighed against the prompt tokens its cache saves): auto (measured on each "
        "replica's engine at start) or a number for every replica",
    )
    max_replicas: int | None = opt(
        None,
        "autoscale between data_parallel_size and this many replicas on requests in flight (Ray Serve's autoscaling)",
    )
    target_ongoing_requests: float = opt(8.0, "requests in flight per replica autoscaling aims at")
    replica_cpus: float | None = opt(None, "Ray CPUs reserved per replica (default: the machine's cores shared out)")
    replica_gpus: float = opt(0.0, "Ray GPUs per replica (use with --device cuda)")
    replica_threads: int | None = opt(None, "torch threads per replica (default: cores / replicas, at least 1)")
    prefill_replicas: int = opt(
        0, "disaggregated serving: replicas that only compute prompts' KV (with --decode-replicas)"
    )
    decode_replicas: int = opt(
        0, "disaggregated serving: replicas that decode from the KV the prefill replicas send them"
    )

    def __post_init__(self) -> None:
        _check(self.data_parallel_size >= 1, f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        _check(
            self.max_replicas is None or self.max_replicas >= self.data_parallel_size,
            f"max_replicas ({self.max_replicas}) must be >= data_parallel_size ({self.data_parallel_size})",
        )
        _check(
            self.target_ongoing_requests > 0, f"target_ongoing_requests must be > 0, got {self.target_ongoing_requests}"
        )
        _check(
            self.route_load_cost == "auto" or str(self.route_load_cost).isdigit(),
            f"route_load_cost must be auto or a whole number of tokens >= 0, got {self.route_load_cost!r}",
        )
        _check(
            self.replica_cpus is None or self.replica_cpus >= 0, f"replica_cpus must be >= 0, got {self.replica_cpus}"
        )
        _check(self.replica_gpus >= 0, f"replica_gpus must be >= 0, got {self.replica_gpus}")
        _check(
            self.replica_threads is None or self.replica_threads >= 1,
            f"replica_threads must be >= 1, got {self.replica_threads}",
        )
        _check(
            (self.prefill_replicas == 0) == (self.decode_replicas == 0),
            "disaggregated serving needs both --prefill-replicas and --decode-replicas",
        )
        _check(self.prefill_replicas >= 0 and self.decode_replicas >= 0, "replica counts must be >= 0")
        _check(
            not (self.disaggregated and (self.data_parallel_size > 1 or self.max_replicas)),
            "--prefill-replicas/--decode-replicas replace --data-parallel-size and --max-replicas",
        )

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    @property
    def fixed_load_cost(self) -> int | None:
        """``route_load_cost`` as a number of tokens, or None for auto (each replica's measured price)."""
        return None if self.route_load_cost == "auto" else int(self.route_load_cost)

    @property
    def enabled(self) -> bool:
        """Whether the server runs its engines as Ray Serve replicas."""
        return self.ray or self.data_parallel_size > 1 or self.max_replicas is not None or self.disaggregated


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
