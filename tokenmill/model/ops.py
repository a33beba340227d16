"""The per-layer ops a decoder calls, in two implementations behind one interface.

``TorchOps`` is the reference: plain PyTorch, any device, any dtype. ``NativeOps``
sends CPU tensors in float32 or bfloat16 to the C++ kernels (``torch.ops.tokenmill``)
and anything else to the reference, so a model never branches on where it runs. The
tests hold every native op to its reference twin.

Attention has two sides: sequences whose new tokens are the whole context (a fresh
prefill) attend over their own fresh K/V with SDPA's flash kernel; every sequence
that reads cached K/V (decodes, chunks after a cached prefix, speculative
verification) goes through ``paged_attention``: the reference gathers blocks, the
native kernel reads them in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.kernels.linear import FLOAT_ROWS
from tokenmill.model.layers.attention import (
    AttentionMetadata,
    context_prefill_attention,
    fresh_prefill_attention,
    paged_attention,
    tree_attention,
)
from tokenmill.model.layers.kv_cache import KVCacheLayer
from tokenmill.model.layers.norm import rms_norm
from tokenmill.model.layers.rotary import RotaryEmbedding
from tokenmill.quant.blocks import INT8_MAX_ROWS
from tokenmill.quant.packed import EXACT_BF16_ROWS

NATIVE_DTYPES = (torch.float32, torch.bfloat16)
# A fresh prefill at least this long goes to SDPA's flash kernel (GEMM-shaped work);
# shorter ones ride along in the paged kernel's single call.
FRESH_PREFILL_SDPA_MIN = 64
PARTITION_TOKENS = 256  # FlashDecoding split of a long context across threads
# Steps of up to this many tokens run their layers in C++ (decode_layers) where the model
# allows: within the float linears' small-batch kernel range, and the rows the quantised
# linears multiply with float32 weights under any dtype (the C++ loop asks for those).
FUSED_MAX_TOKENS = min(FLOAT_ROWS, EXACT_BF16_ROWS)
# ... and up to this many where every linear is in GGUF blocks (their kernel takes any rows; on
# float32 activations the C++ loop then runs the step in one team of threads): batched decode.
BLOCKS_FUSED_MAX_TOKENS = INT8_MAX_ROWS


class TorchOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place, the decoder's residual stream); returns its RMSNorm."""
        residual.add_(x)
        return self.rms_norm(residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        cache: KVCacheLayer,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q and k, then k and v into their cache slots; returns the rotated q, k."""
        q, k = rotary(positions, q, k)
        cache.write(k, v, slot_mapping)
        return q, k

    def long_rows(self, meta: AttentionMetadata) -> tuple[tuple[int, int], ...] | None:
        """The row ranges of this step that may take a GGUF weight's dequantised GEMM where its
        type's row count says so (QuantLinear's ``long_rows``); None: decided by each call's rows."""
        return None

    def head_long_rows(self) -> tuple[tuple[int, int], ...] | None:
        """``long_rows`` for the LM head, whose rows are one per sequence (or a prompt's scored
        tokens): none where the arithmetic must not depend on the step (None: the call decides)."""
        return None

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCacheLayer,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of the new tokens (their K/V already in the cache); with ``window``,
        each query sees only the last ``window`` positions up to its own; with ``softcap``,
        scores are soft-capped (Gemma 2)."""
        return paged_attention(q, k, v, cache, meta, scale, window, softcap)

    def decoder_layers(self, x, h, plan, positions, rotary, kv_caches, meta) -> torch.Tensor | None:
        """Every layer of a plain decoder in one call (``plan``: the model's ``fused_plan``),
        or None: the model runs its layers one by one (always, in the reference)."""
        return None


class NativeOps(TorchOps):
    """``batch_invariant``: every query's attention the same arithmetic whatever else its step
    holds: fresh prefills take the paged kernel too (not SDPA; over a quantised cache, the cache's
    K/V as a prefix hit reads them, not their own fresh ones), in partitions of one size. The
    int8 arithmetic asks for it: its activations' 8-bit rounding turns the ~1e-7 by which SDPA's
    sums differ from the paged kernel's into other greedy tokens, where float absorbs them.

    ``invariant_below``: where a machine's probe chose the dequantised bfloat16 GEMM for GGUF
    blocks from that many rows (kernels/gemm_choice.block_gemm_rows; None: never), a sequence
    with that many new tokens in a step (a long prompt chunk) has numbers of its own already: its
    rows may take the GEMM (``long_rows``), and a fresh one takes SDPA as float models' do (on a
    Sapphire Rapids class Xeon, oneDNN's AMX: 1.6 ms a layer for a 512-token prompt against the
    paged kernel's 4.1). Every shorter sequence (decodes, short prompts, the tails of cached
    ones) keeps the integer dots and the paged kernel whatever else its step holds: the choice
    is per sequence, never by the step's total rows, which its neighbours decide."""

    name = "native"

    def __init__(self, batch_invariant: bool = False, invariant_below: int | None = None) -> None:
        self.batch_invariant = batch_invariant
        self.invariant_below = invariant_below

    @property
    def _fresh_sdpa_min(self) -> int:
        if not self.batch_invariant:
            return FRESH_PREFILL_SDPA_MIN
        return 1 << 62 if self.invariant_below is None else max(self.invariant_below, FRESH_PREFILL_SDPA_MIN)

    def long_rows(self, meta: AttentionMetadata) -> tuple[tuple[int, int], ...] | None:
        if not self.batch_invariant:
            return None
        return () if self.invariant_below is None else meta.long_chunks(self.invariant_below)

    def head_long_rows(self) -> tuple[tuple[int, int], ...] | None:
        return () if self.batch_invariant else None

    @property
    def _partition(self) -> int:
        return -PARTITION_TOKENS if self.batch_invariant else PARTITION_TOKENS

    def _native(self, *tensors: torch.Tensor) -> bool:
        return all(t.device.type == "cpu" and t.dtype in NATIVE_DTYPES for t in tensors)

    def rms_norm(self, x, weight, eps):
        if not self._native(x) or x.dtype != weight.dtype:
            return super().rms_norm(x, weight, eps)
        return torch.ops.tokenmill.rms_norm(x.contiguous(), weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if not self._native(x) or x.dtype != weight.dtype or not residual.is_contiguous():
            return super().add_rms_norm(x, residual, weight, eps)
        return torch.ops.tokenmill.add_rms_norm(x.contiguous(), residual, weight, eps)

    def rotary_write_kv(self, q, k, v, positions, rotary, cache, slot_mapping):
        if not self._native(q) or q.shape[-1] > 512:
            return super().rotary_write_kv(q, k, v, positions, rotary, cache, slot_mapping)
        if cache.quant is None and cache.k.dtype in NATIVE_DTYPES:
            torch.ops.tokenmill.rotary_write_kv(
                q, k, v, positions, rotary.cos, rotary.sin, cache.k, cache.v, slot_mapping
            )
        else:  # quantised (or float16) storage: rotate natively, quantise in torch
            torch.ops.tokenmill.rotary(q, k, positions, rotary.cos, rotary.sin)
            cache.write(k, v, slot_mapping)
        return q, k

    def attention(self, q, k, v, cache, meta, scale, window=None, softcap=None):
        if not self._native(q):
            return super().attention(q, k, v, cache, meta, scale, window, softcap)
        q = q.contiguous()
        out = torch.empty_like(q)
        # Over a quantised cache, fresh prefills take their fresh K/V (as the reference does), unless
        # batch-invariant: then every query reads the cache, so that a prompt's numbers do not depend
        # on whether its prefix was cached (a prefix hit reads the quantised K/V).
        if cache.quant:
            fresh_min = (1 << 62) if self.batch_invariant else 1
        else:
            fresh_min = self._fresh_sdpa_min
        # long chunks over a cached context: SDPA's flash kernel too, where it computes what the
        # paged kernel does (no window, no soft cap, an unquantised cache), as fresh ones do
        plain = cache.quant is None and window is None and softcap is None
        index = meta.kernel_index(fresh_min, self._fresh_sdpa_min if plain else None)
        if index.paged_seq_ids.numel():
            torch.ops.tokenmill.paged_attention(
                out,
                q,
                cache.k,
                cache.v,
                cache.k_scale,
                cache.v_scale,
                meta.block_tables,
                index.query_start_loc,
                index.seq_lens,
                index.paged_seq_ids,
                scale,
                self._partition,
                window or 0,
                softcap or 0.0,
            )
        qsl = meta.query_start_loc
        for i in index.fresh_seqs:  # long fresh prefills: their own K/V, causal, flash SDPA
            start, end = qsl[i], qsl[i + 1]
            out[start:end] = fresh_prefill_attention(q[start:end], k[start:end], v[start:end], scale, window, softcap)
        for i in index.context_seqs:  # long chunks over a cached context: flash SDPA twice, merged
            start, end = qsl[i], qsl[i + 1]
            out[start:end] = context_prefill_attention(
                q[start:end], k[start:end], v[start:end], cache, meta.block_tables[i], meta.seq_lens_host[i], scale
            )
        for i in meta.tree_masks:  # token trees: the reference's masked attention
            start, end = qsl[i], qsl[i + 1]
            out[start:end] = tree_attention(q[start:end], cache, meta, i, scale, softcap)
        return out

    def decoder_layers(self, x, h, plan, positions, rotary, kv_caches, meta):
        first = kv_caches[0]
        if (
            x.shape[0] > (BLOCKS_FUSED_MAX_TOKENS if plan.blocks_only else FUSED_MAX_TOKENS)
            or not self._native(x)
            or first.quant is not None
            or first.k.dtype not in NATIVE_DTYPES
        ):
            return None
        index = meta.kernel_index(self._fresh_sdpa_min, self._fresh_sdpa_min)
        # a long prefill chunk takes SDPA, a tree its mask: the Python loop
        if index.fresh_seqs or index.context_seqs or meta.tree_masks:
            return None
        return torch.ops.tokenmill.decode_layers(
            x,
            h,
            layer_stack(plan, kv_caches),
            positions,
            rotary.cos,
            rotary.sin,
            meta.slot_mapping,
            meta.block_tables,
            index.query_start_loc,
            index.seq_lens,
            index.paged_seq_ids,
            plan.scale,
            plan.eps,
            plan.num_heads,
            plan.num_kv_heads,
            plan.head_dim,
            self._partition,
        )


def layer_stack(plan, kv_caches: list[KVCacheLayer]):
    """The plan's tensors and the caches as one C++ object (decode_loop.cpp's LayerStack), kept on
    the plan while the caches are the same tensors: passing the ~500 tensors as lists on every
    step cost ~0.45 ms (the dispatcher boxes each)."""
    caches = tuple(c.k for c in kv_caches)
    held = plan.native_stack
    if held is None or len(held[0]) != len(caches) or any(a is not b for a, b in zip(held[0], caches, strict=True)):
        stack = torch.classes.tokenmill.LayerStack(plan.weights, plan.kinds, list(caches), [c.v for c in kv_caches])
        plan.native_stack = held = (caches, stack)
    return held[1]


def select_ops(device: torch.device, kernels: str = "auto", batch_invariant: bool = False) -> TorchOps:
    """``auto``: native kernels on the CPU where they build, the reference elsewhere;
    ``native``: insist (an error if they do not build); ``torch``: the reference.
    ``batch_invariant``: NativeOps's."""
    if kernels not in ("auto", "native", "torch"):
        raise ValueError(f"kernels must be auto, native or torch, got {kernels!r}")
    if kernels == "torch" or (kernels == "auto" and device.type != "cpu"):
        return TorchOps()
    from tokenmill.kernels.native import load_native

    if load_native():
        return NativeOps(batch_invariant)
    if kernels == "native":
        raise RuntimeError(
            "kernels='native' asked for, but the native CPU kernels did not build (see the warning above)"
        )
    return TorchOps()
