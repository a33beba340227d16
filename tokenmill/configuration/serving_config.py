"""The server's options (``ServerConfig``: HTTP, admission, the response cache, routers,
reasoning) and the engine replicas' (``ReplicaConfig``: Ray Serve), in the form of
``configuration/config.py``'s: frozen dataclasses whose fields carry their help text, so that the CLI
flags are generated from them; every default written once, and every range: a field's
``check`` is its flag's type (a bad value fails at parsing, exit 2) and what
``check_fields`` holds a config built from keywords to.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.configuration.config import opt, require
from tokenmill.configuration.flag_types import (
    NON_NEGATIVE_FLOAT,
    NON_NEGATIVE_INT,
    PORT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    PROBABILITY,
    BadValue,
    Number,
    check_fields,
    existing_file,
)
from tokenmill.configuration.memory import memory_size

RESPONSE_CACHES = ("off", "exact", "semantic")
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # server/jobs/reasoning.py


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server."""

    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(8000, "port to listen on", check=PORT)
    api_key: tuple[str, ...] = opt(
        (),
        "require 'Authorization: Bearer KEY' on /v1 routes; give it once per key: "
        "each key is a tenant of its own (the response cache never crosses them)",
        repeat=True,
    )
    api_key_file: str | None = opt(
        None,
        "a file of API keys, one per line (blank lines and # comments skipped), added to --api-key's",
        check=existing_file,
    )
    priority_api_key: tuple[str, ...] = opt(
        (),
        "with --scheduling-policy priority: requests with 'Authorization: Bearer KEY' may send any "
        "priority, one below --min-priority (ahead of others) too; give it once per key; with "
        "--api-key, each must be one of those keys",
        repeat=True,
    )
    min_priority: int = opt(
        0,
        "with --scheduling-policy priority: the lowest priority (lower goes first) a request without a "
        "--priority-api-key may send; lower is a 400. 0: no such client puts itself ahead of the default",
        check=Number(int, -(2**31 - 1), 2**31 - 1),
    )
    max_queue: int | None = opt(
        1024,
        "answer 429 (with Retry-After) while this many engine sequences wait for a place in the batch; 0: no limit",
        check=NON_NEGATIVE_INT,
    )
    max_prompts_per_request: int = opt(
        2048, "most prompts in one completions request; more get 400", check=POSITIVE_INT
    )
    max_embedding_inputs: int = opt(
        2048, "most texts in one embeddings, pooling, score or rerank request; more: 400", check=POSITIVE_INT
    )
    max_request_tokens: int = opt(
        262144,
        "most prompt tokens in one request, all its prompts or inputs together; more get 400",
        check=POSITIVE_INT,
    )
    max_inflight_prompts_per_client: int = opt(
        32,
        "fairness: the prompts of a request that has several enter the "
        "engine at most this many at a time per client (API key, else "
        "address), so that other clients' requests share the steps",
        check=POSITIVE_INT,
    )
    drain_timeout: float = opt(30.0, "seconds SIGTERM waits for in-flight requests", check=NON_NEGATIVE_FLOAT)
    served_model_name: str | None = opt(None, "the model id clients send (default: the model's file name)")
    max_request_bytes: int = opt(2 << 20, "largest request body accepted; larger ones get 413", check=POSITIVE_INT)
    request_body_timeout: float = opt(
        30.0, "seconds a client has to send a request's whole body; then 408", check=POSITIVE_FLOAT
    )
    max_open_requests: int = opt(
        1024,
        "most HTTP requests open at once (bodies still arriving and streams "
        "included); more get 503 until some finish (/health and /metrics exempt)",
        check=POSITIVE_INT,
    )
    max_connections_per_client: int = opt(
        256,
        "most connections open at once from one client address (an IPv6 "
        "address: its /64); more are answered 429 and closed",
        check=POSITIVE_INT,
    )
    max_unfinished_bodies_per_client: int = opt(
        128, "most requests from one client address whose bodies are still arriving; more get 429", check=POSITIVE_INT
    )
    request_header_timeout: float = opt(
        5.0,
        "seconds a connection has to send a whole request head, from its start or its last response; then it is closed",
        check=POSITIVE_FLOAT,
    )
    allow_runtime_lora_updating: bool = opt(False, "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    trust_request_chat_template: bool = opt(
        False,
        "let a chat request bring its own Jinja template (vLLM's chat_template field; rendered in a "
        "sandbox, in worker processes with the --request-template-* limits): refused with 400 by default",
    )
    request_template_timeout: float = opt(
        5.0,
        "seconds a request's chat template may take to render (its worker process is then "
        "stopped: 400); also how long a request waits for a free worker before a 429",
        check=POSITIVE_FLOAT,
    )
    request_template_memory: str = opt(
        "512MiB",
        "memory one render of a request's chat template may take (a worker's address space); more: 400",
        check=memory_size,
    )
    request_template_max_chars: int = opt(
        4 << 20,
        "characters a request's chat template may render (or build with '*' in one step); more: 400",
        check=POSITIVE_INT,
    )
    request_template_workers: int = opt(
        2,
        "worker processes rendering request chat templates, so at most this many at once (others wait)",
        check=POSITIVE_INT,
    )
    allow_special_tokens_in_messages: bool = opt(
        False,
        "tokenise special-token text in chat messages (and tools) as "
        "special tokens, as the rendered prompt reads: a client can then "
        "end its turn and forge a system one (default: as plain text; "
        "the template's own markers stay special)",
    )
    context_shift: bool = opt(
        False,
        "a chat longer than the model's context (or leaving no room for its max_tokens; without "
        "max_tokens, for a quarter of the context) drops its oldest turns, whole, its system "
        "messages and latest turn kept, instead of a 400 (llama.cpp's context shift, at turn "
        "boundaries); the answer says what was dropped (context_shift) and "
        "tokenmill:context_shift_requests counts them. Chat completions, not beam search",
    )
    kv_eviction_window: int | None = opt(
        None,
        "KV eviction for every request that names none (StreamingLLM): past this many recent tokens "
        "the K/V of the tokens between the first ones (--kv-eviction-sinks) and the last this-many "
        "go back to the pool, so a request holds a bounded cache and may run past the context; a "
        'request\'s kv_eviction ({"window": N} or {"policy": "none"}) wins. Not with beam search',
        check=POSITIVE_INT,
    )
    kv_eviction_sinks: int = opt(
        4, "KV eviction: first tokens always kept (the attention sinks; whole KV blocks)", check=NON_NEGATIVE_INT
    )
    kv_eviction_policy: str = opt(
        "streaming",
        "KV eviction's policy for --kv-eviction-window: streaming (StreamingLLM: sinks and a recent "
        "window; past the context) or snapkv (a prompt longer than the window keeps, once read, the "
        "window's worth of its tokens that its last 32 attend to most; within the context)",
        choices=("streaming", "snapkv"),
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
        1000,
        "responses kept for previous_response_id and GET /v1/responses/{id} (store: true; the oldest go first)",
        check=NON_NEGATIVE_INT,
    )
    stored_response_ttl: float = opt(3600.0, "seconds a stored response is kept", check=POSITIVE_FLOAT)
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
    response_cache_memory: str = opt(
        "256MiB", "the response cache's size; the least recently used answers go first", check=memory_size
    )
    response_cache_ttl: float = opt(3600.0, "seconds a cached answer is served", check=POSITIVE_FLOAT)
    semantic_cache_threshold: float = opt(
        0.9995,
        "--response-cache semantic: the cosine similarity of the last user "
        "messages' embeddings from which a cached answer is served (the "
        "default admits no false hit on bench/semantic_pairs.json with the "
        "default model's own embeddings: see bench/RESULTS.md)",
        check=Number(float, 0, 1, open_low=True),
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
        check=PROBABILITY,
    )
    router_max_prompt_tokens: int | None = opt(
        None, "routers: prompts longer than this go straight to the large model", check=POSITIVE_INT
    )
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
        43200.0,
        "with --api-key: seconds a sign-in to the web page lasts (then it asks for the key again)",
        check=POSITIVE_FLOAT,
    )
    watts_per_cpu: float | None = opt(
        None,
        "energy: estimate joules as this power per busy logical CPU times the server's CPU seconds, "
        "even where RAPL is readable (default: RAPL's measured joules where readable, else this "
        "estimate at 3 W per busy CPU); /metrics' tokenmill:energy_joules_total says which",
        check=POSITIVE_FLOAT,
    )
    price_per_hour: float | None = opt(
        None,
        "cost: what the machine costs per hour; the live page shows $ per 1M tokens at the current load",
        check=NON_NEGATIVE_FLOAT,
    )

    def __post_init__(self) -> None:
        for name in ("api_key", "priority_api_key"):
            if isinstance(getattr(self, name), str):  # one key, as a keyword
                object.__setattr__(self, name, (getattr(self, name),))
        check_fields(self)  # every field's declared range
        require(
            self.response_cache in RESPONSE_CACHES,
            f"response_cache must be one of {', '.join(RESPONSE_CACHES)}, got {self.response_cache!r}",
        )
        require(
            self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
            f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}",
        )
        unknown = sorted(set(self.router_large_for) - {"tools", "response_format", "logprobs", "none"})
        require(
            not unknown, f"router_large_for takes tools, response_format, logprobs or none, not {', '.join(unknown)}"
        )


def _load_cost(value: int | str) -> int | str:
    """``--route-load-cost``'s check: auto, or a whole number of tokens >= 0."""
    if value == "auto":
        return value
    try:
        NON_NEGATIVE_INT(value)
    except BadValue:
        raise BadValue(f"must be auto or a whole number of tokens >= 0, got {value!r}") from None
    return value


@dataclass(frozen=True)
class ReplicaConfig:
    """Engine replicas behind one server, on Ray Serve (``pip install tokenmill[ray]``):
    data-parallel copies with a router, or prefill and decode pools. The Ray cluster is
    the one ``RAY_ADDRESS`` names, else a local one started for the server."""

    data_parallel_size: int = opt(
        1, "engine replicas behind this server, each with its own KV cache (Ray Serve)", check=POSITIVE_INT
    )
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
        check=_load_cost,
    )
    max_replicas: int | None = opt(
        None,
        "autoscale between data_parallel_size and this many replicas on requests in flight (Ray Serve's autoscaling)",
        check=POSITIVE_INT,
    )
    target_ongoing_requests: float = opt(
        8.0, "requests in flight per replica autoscaling aims at", check=POSITIVE_FLOAT
    )
    replica_cpus: float | None = opt(
        None, "Ray CPUs reserved per replica (default: the machine's cores shared out)", check=NON_NEGATIVE_FLOAT
    )
    replica_gpus: float = opt(0.0, "Ray GPUs per replica (use with --device cuda)", check=NON_NEGATIVE_FLOAT)
    replica_threads: int | None = opt(
        None, "torch threads per replica (default: cores / replicas, at least 1)", check=POSITIVE_INT
    )
    prefill_replicas: int = opt(
        0,
        "disaggregated serving: replicas that only compute prompts' KV (with --decode-replicas)",
        check=NON_NEGATIVE_INT,
    )
    decode_replicas: int = opt(
        0,
        "disaggregated serving: replicas that decode from the KV the prefill replicas send them",
        check=NON_NEGATIVE_INT,
    )

    def __post_init__(self) -> None:
        check_fields(self)  # every field's declared range
        require(
            self.max_replicas is None or self.max_replicas >= self.data_parallel_size,
            f"max_replicas ({self.max_replicas}) must be >= data_parallel_size ({self.data_parallel_size})",
        )
        require(
            (self.prefill_replicas == 0) == (self.decode_replicas == 0),
            "disaggregated serving needs both --prefill-replicas and --decode-replicas",
        )
        require(
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
