"""Frozen configuration dataclasses, one per concern.

Derived values (head size, KV bytes per token) are properties so that nothing is
mutated after construction.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as Hugging Face's `rope_scaling` describes it."""

    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder; filled from GGUF metadata or config.json."""

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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V stored per token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


SPECULATIVE_METHODS = ("ngram", "draft", "self")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes, how many tokens, and when to stop bothering.

    ``method``: "ngram" (prompt lookup, no model), "draft" (a smaller model with the
    same vocabulary) or "self" (the target's first ``draft_layers`` layers and its LM
    head). Above ``disable_batch_size`` running requests decode is no longer
    memory-bound enough for verification to pay, and speculation pauses.
    """

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    draft_model: str | None = None
    draft_layers: int | None = None
    disable_batch_size: int = 4

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs a draft model (--draft-model)")
        if self.method == "self" and (self.draft_layers is None or self.draft_layers < 1):
            raise ValueError("speculative method 'self' needs draft_layers >= 1 (--draft-layers)")
        if self.disable_batch_size < 1:
            raise ValueError("spec_disable_batch_size must be >= 1")

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a model-based proposer writes past the verified tokens while drafting."""
        return 0 if self.method == "ngram" else self.num_speculative_tokens
