"""Rotary position embedding (rotate-half layout, as Hugging Face's Llama).

cos/sin are precomputed once for every position up to the context length and
indexed by each token's absolute position, so a flat batch mixing sequences at
different offsets needs no per-sequence work.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.configuration.config import RopeScaling


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, freq_factors: torch.Tensor | None = None
) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:  # GGUF llama3 models store per-frequency divisors
        inv_freq = inv_freq / freq_factors.float()
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "longrope":  # the short factors; long_inverse_frequencies gives the others
        return inv_freq / torch.tensor(scaling.short_factor, dtype=torch.float32)
    if scaling.rope_type == "llama3":
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {scaling.rope_type!r}")


def rotary_for(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    max_positions: int,
    freq_factors: torch.Tensor | None = None,
) -> RotaryEmbedding:
    """The model's rotary table. LongRoPE (Phi-3) uses its short factors for positions
    within the original context and its long ones beyond (per position, as vLLM does; a
    sequence that stays within the original context sees exactly transformers' RoPE),
    and scales cos and sin by its attention factor."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling, freq_factors)
    if scaling is None or scaling.rope_type != "longrope":
        return RotaryEmbedding(inv_freq, max_positions)
    base = inverse_frequencies(head_dim, theta, None)
    long = base / torch.tensor(scaling.long_factor, dtype=torch.float32)
    return RotaryEmbedding(
        inv_freq, max_positions, long, scaling.original_max_position_embeddings, scaling.attention_factor
    )


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        inv_freq: torch.Tensor,
        max_positions: int,
        long_inv_freq: torch.Tensor | None = None,
        long_from: int = 0,
        scale: float = 1.0,
    ) -> None:
        super().__init__()
        # Keys move to other positions by one rotation (``shift``) unless frequencies depend on
        # the position (LongRoPE's long factors) or cos and sin are scaled.
        self.shiftable = long_inv_freq is None and scale == 1.0
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
        if long_inv_freq is not None:  # positions from long_from on rotate at other frequencies
            freqs[long_from:] = torch.outer(positions[long_from:], long_inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)  # [max_positions, head_dim]
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [num_tokens]; q: [num_tokens, heads, head_dim]; k: [num_tokens, kv_heads, head_dim]
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def shift(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys ``k`` [..., head_dim] (float32) rotated at position p, rotated at p + delta
        instead: RoPE turns each frequency's pair by an angle proportional to the position, so
        one more turn by ``delta`` times it moves a key (angles in float64: exact at any delta)."""
        assert self.shiftable, "keys rotated with position-dependent frequencies cannot be shifted"
        angles = delta * self.inv_freq.double()
        emb = torch.cat((angles, angles)).to(k.device)
        return k * emb.cos().float() + _rotate_half(k) * emb.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
