"""Paged attention: K/V live in fixed-size blocks, addressed by block tables.

Per layer the cache (``KVCacheLayer``) is K and V ``[num_blocks, block_size,
num_kv_heads, head_dim]``, plain or quantised with per-token scales.
A token at absolute position p of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``; the caller computes
these slots (``slot_mapping``) so that attention never needs to know who owns a block.

The flat batch holds the sequences' new tokens back to back, decodes first::

    tokens:  | d0 | d1 | d2 | p0 p0 p0 p0 p0 | p1 p1 p1 |
              one token each    prefill chunks (any length, any cached prefix)

This module is the pure-torch reference (and the path on GPUs): decodes come sorted
by context length and are attended in a few batched calls, one per group of similar
lengths (``DecodeGroup``, built on first use in a step), over their gathered, padded
context; prefill chunks one sequence at a time with a causal mask offset by the number
of tokens already in the cache. The native CPU kernel (``tokenmill.kernels``) reads
the same blocks in place instead, from ``AttentionMetadata.kernel_index``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from tokenmill.model.layers.kv_cache import KVCacheLayer

# Cached tokens a long chunk's attention reads at a time (context_prefill_attention): a 1B float
# model's 8k context gathered whole, its 8 K/V heads repeated to 32, was 128 MB a layer.
CONTEXT_SEGMENT = 2048


@dataclass
class DecodeGroup:
    """Decode sequences [start, end) of the batch, padded to a common context length."""

    start: int
    end: int
    num_blocks: int  # blocks gathered per sequence
    block_ids: torch.Tensor  # [(end - start) * num_blocks] int64: their tables, flattened
    mask: torch.Tensor  # [end - start, 1, 1, num_blocks * block_size] bool: real tokens
    lens: torch.Tensor  # [end - start] int64: context lengths
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # built once per step

    def window_mask(self, window: int | None) -> torch.Tensor:
        """The mask, keeping only each sequence's last ``window`` tokens (built on the
        first windowed layer of the step, shared by the others)."""
        if window is None:
            return self.mask
        if window not in self._window_masks:
            positions = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self._window_masks[window] = (
                self.mask & (positions[None, :] >= self.lens[:, None] - window)[:, None, None, :]
            )
        return self._window_masks[window]


def build_decode_groups(
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    ratio: float = 1.5,
    max_groups: int = 6,
) -> list[DecodeGroup]:
    """Split decodes (sorted by context length, or the groups pad more) into groups whose
    longest is at most ``ratio`` x their shortest, so a long context does not pad every
    short one."""
    bounds: list[list[int]] = []
    for i, n in enumerate(seq_lens):
        if bounds and (n <= ratio * seq_lens[bounds[-1][0]] or len(bounds) == max_groups):
            bounds[-1][1] = i + 1
        else:
            bounds.append([i, i + 1])
    groups = []
    for start, end in bounds:
        num_blocks = -(-max(seq_lens[start:end]) // block_size)
        ids = [b for t in block_tables[start:end] for b in (t + [0] * num_blocks)[:num_blocks]]
        lens = torch.tensor(seq_lens[start:end], device=device)
        mask = torch.arange(num_blocks * block_size, device=device)[None, :] < lens[:, None]
        groups.append(
            DecodeGroup(start, end, num_blocks, torch.tensor(ids, device=device), mask[:, None, None, :], lens)
        )
    return groups


@dataclass
class KernelIndex:
    """The native kernel's view of a step: which sequences it attends (decodes, short chunks)
    and which go to SDPA's flash kernel (long fresh prefills; long chunks over a cached context)."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int64, CPU
    seq_lens: torch.Tensor  # [num_seqs] int64, CPU
    paged_seq_ids: torch.Tensor  # int64, CPU
    fresh_seqs: list[int]
    context_seqs: list[int] = field(default_factory=list)  # context_prefill_attention's


@dataclass
class AttentionMetadata:
    """Everything attention needs about the flat batch; built by the model runner.

    The per-path views (decode groups for the reference, the kernel index for the
    native kernel) are built on first use, once per step, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    query_start_loc: list[int]  # num_seqs + 1 offsets into the flat batch (host)
    seq_lens_host: list[int]  # per sequence: context length including the new tokens
    num_decodes: int  # the first num_decodes sequences contribute exactly one token
    block_size: int
    block_tables_host: list[list[int]]  # the sequences' own tables (read, not copied)
    # Sequences verifying (or a head drafting) a token tree: seq index -> [num_new, T] bool,
    # which of the last T keys (the tree's slots) each new token sees; every key before them is seen.
    tree_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # Rows of the flat batch whose queries (after RoPE) each layer appends to ``kept_queries``
    # (SnapKV's observed tokens); None: none kept.
    query_rows: torch.Tensor | None = None
    kept_queries: list[torch.Tensor] = field(default_factory=list)
    # by (fresh_sdpa_min, context_sdpa_min)
    _kernel_indexes: dict[tuple[int, int | None], KernelIndex] = field(default_factory=dict, repr=False)
    _long_chunks: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict, repr=False)  # by min_rows

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @cached_property
    def decode_groups(self) -> list[DecodeGroup]:
        nd = self.num_decodes
        return build_decode_groups(
            self.seq_lens_host[:nd], self.block_tables_host[:nd], self.block_size, self.slot_mapping.device
        )

    def long_chunks(self, min_rows: int) -> tuple[tuple[int, int], ...]:
        """The row ranges [start, end) of the sequences with at least ``min_rows`` new tokens
        (long prompt chunks), in batch order."""
        if min_rows not in self._long_chunks:
            qsl = self.query_start_loc
            spans = tuple((qsl[i], qsl[i + 1]) for i in range(self.num_seqs) if qsl[i + 1] - qsl[i] >= min_rows)
            self._long_chunks[min_rows] = spans
        return self._long_chunks[min_rows]

    def kernel_index(self, fresh_sdpa_min: int, context_sdpa_min: int | None = None) -> KernelIndex:
        """Fresh prefills at least ``fresh_sdpa_min`` long go to SDPA, and chunks of at least
        ``context_sdpa_min`` new tokens over a cached context (None: none) to
        context_prefill_attention; every other sequence to the kernel. Built once per step and
        thresholds, shared by every layer."""
        key = (fresh_sdpa_min, context_sdpa_min)
        if key in self._kernel_indexes:
            return self._kernel_indexes[key]
        qsl, lens = self.query_start_loc, self.seq_lens_host
        fresh, context = [], []
        for i in range(self.num_decodes, self.num_seqs):
            new = qsl[i + 1] - qsl[i]
            if i in self.tree_masks:
                continue
            if lens[i] == new and lens[i] >= fresh_sdpa_min:
                fresh.append(i)
            elif lens[i] > new and context_sdpa_min is not None and new >= context_sdpa_min:
                context.append(i)
        skip = set(fresh) | set(context) | set(self.tree_masks)  # trees: tree_attention
        index = KernelIndex(
            torch.tensor(qsl, dtype=torch.long),
            torch.tensor(lens, dtype=torch.long),
            torch.tensor([i for i in range(self.num_seqs) if i not in skip], dtype=torch.long),
            fresh,
            context,
        )
        self._kernel_indexes[key] = index
        return index


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCacheLayer,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim] (new tokens).

    The new tokens' K/V are already in the cache (written with RoPE, ``TorchOps.rotary_write_kv``);
    returns [num_tokens, heads, head_dim]. With a sliding ``window``, the query at
    position p sees positions p - window + 1 .. p (blocks entirely before that may
    already hold another request's tokens: they are read, but masked out). With
    ``softcap`` (Gemma 2) the scores go through ``softcap * tanh(s / softcap)``.
    """
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode_attention(q[:nd], cache, meta, scale, window, softcap)
    qsl = meta.query_start_loc
    for i in range(nd, meta.num_seqs):
        start, end = qsl[i], qsl[i + 1]
        if i in meta.tree_masks:
            out[start:end] = tree_attention(q[start:end], cache, meta, i, scale, softcap)
            continue
        out[start:end] = _prefill_attention(
            q[start:end], k[start:end], v[start:end], cache, meta, i, scale, window, softcap
        )
    return out


def _gather(cache: KVCacheLayer, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous [length, kv_heads, head_dim] K and V of one sequence's cached tokens."""
    num_blocks = -(-length // cache.block_size)
    keys, values = cache.gather(block_table[:num_blocks])
    return keys.flatten(0, 1)[:length], values.flatten(0, 1)[:length]


def _decode_attention(
    q, cache: KVCacheLayer, meta: AttentionMetadata, scale: float, window: int | None, softcap: float | None = None
) -> torch.Tensor:
    """One query token per sequence, over its gathered context, group by group.

    Within a group the query heads that share a K/V head become that head's "query
    length" ([n, kv_heads, groups, head_dim] against [n, kv_heads, S, head_dim]), so
    grouped K/V is never repeated.
    """
    _, num_heads, head_dim = q.shape
    kv_heads = cache.k.shape[2]
    outs = []
    for g in meta.decode_groups:
        n = g.end - g.start
        shape = (n, g.num_blocks * meta.block_size, kv_heads, head_dim)
        keys, values = cache.gather(g.block_ids)
        keys = keys.view(shape).transpose(1, 2)  # [n, kv_heads, S, head_dim]
        values = values.view(shape).transpose(1, 2)
        out = _attend(
            q[g.start : g.end].view(n, kv_heads, num_heads // kv_heads, head_dim),
            keys,
            values,
            g.window_mask(window),
            False,
            scale,
            softcap,
        )
        outs.append(out.reshape(n, num_heads, head_dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def fresh_prefill_attention(
    q, k, v, scale: float, window: int | None = None, softcap: float | None = None
) -> torch.Tensor:
    """A chunk with nothing cached before it: causal attention over its own fresh K/V
    (SDPA's flash kernel), [num_new, heads, head_dim]. Shared with the native path."""
    n = q.shape[0]
    if window is None or n <= window:
        return _attend_chunk(q, k, v, None, True, scale, softcap)
    return _attend_chunk(q, k, v, _causal_mask(torch.arange(n, device=q.device), n, window), False, scale, softcap)


def context_prefill_attention(q, k, v, cache: KVCacheLayer, block_table: torch.Tensor, length: int, scale: float):
    """A long chunk over a cached context (a long prompt's second chunk and on), [num_new,
    heads, head_dim]: its queries against the context (every cached key precedes every query:
    no mask) and against their own fresh K/V (causal), each on SDPA's flash kernel, the two
    merged by their log-sum-exps. Where the paged kernel took each query row alone (an 8k
    prompt's second 4k chunk: 1.0 s a layer on a 2-core EPYC, half the flash kernel's
    speed), this is the flash kernel's tiles, with no [num_new, length] mask made. No sliding
    window, no soft cap, an unquantised cache (the callers check). The context is read
    ``CONTEXT_SEGMENT`` tokens at a time, each segment merged in as it is done: what a layer
    gathers (grouped heads repeated for SDPA) is bounded by the segment, not the context."""
    num_new, bs = q.shape[0], cache.block_size
    q4 = q.transpose(0, 1)[None]
    out, lse = _flash(q4, k.transpose(0, 1)[None], v.transpose(0, 1)[None], True, scale)
    context, step = length - num_new, max(1, CONTEXT_SEGMENT // bs) * bs
    for start in range(0, context, step):
        end = min(context, start + step)
        keys, values = cache.gather(block_table[start // bs : -(-end // bs)])
        keys, values = (t.flatten(0, 1)[: end - start].to(q.dtype).transpose(0, 1)[None] for t in (keys, values))
        seg_out, seg_lse = _flash(q4, keys, values, False, scale)
        merged = torch.logaddexp(lse, seg_lse)
        out = out * torch.exp(lse - merged)[..., None] + seg_out * torch.exp(seg_lse - merged)[..., None]
        lse = merged
    return out[0].transpose(0, 1).to(q.dtype)


def _flash(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU flash kernel with its log-sum-exp ([1, heads, n, d], [1, heads, n] float32),
    grouped K/V heads repeated up front (see _sdpa)."""
    k, v = _repeat_kv(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out.float(), lse


def _causal_mask(q_pos: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """[len(q_pos), length] bool: key position <= query position (and within the window)."""
    k_pos = torch.arange(length, device=q_pos.device)[None, :]
    mask = k_pos <= q_pos[:, None]
    return mask if window is None else mask & (k_pos > q_pos[:, None] - window)


def _prefill_attention(
    q, k, v, cache: KVCacheLayer, meta: AttentionMetadata, i: int, scale: float, window=None, softcap=None
):
    num_new = q.shape[0]
    length = meta.seq_lens_host[i]
    if length == num_new:  # nothing cached before this chunk: use the fresh K/V directly
        return fresh_prefill_attention(q, k, v, scale, window, softcap)
    keys, values = _gather(cache, meta.block_tables[i], length)
    # query j sits at absolute position (length - num_new + j) and sees keys <= that.
    q_pos = torch.arange(length - num_new, length, device=q.device)
    return _attend_chunk(q, keys, values, _causal_mask(q_pos, length, window), False, scale, softcap)


def tree_attention(q, cache: KVCacheLayer, meta: AttentionMetadata, i: int, scale: float, softcap=None) -> torch.Tensor:
    """Sequence i's new tokens over its cached context, the last T keys (a token tree's
    slots: siblings side by side, not one after the other) seen as ``meta.tree_masks[i]``
    says. Shared with the native path, which leaves tree sequences to this function.
    (No sliding windows: trees are not drafted for windowed models.)"""
    length = meta.seq_lens_host[i]
    keys, values = _gather(cache, meta.block_tables[i], length)
    tree = meta.tree_masks[i]
    mask = torch.ones(q.shape[0], length, dtype=torch.bool, device=q.device)
    mask[:, length - tree.shape[1] :] = tree
    return _attend_chunk(q, keys, values, mask, False, scale, softcap)


def _attend_chunk(q, keys, values, mask: torch.Tensor | None, causal: bool, scale: float, softcap=None) -> torch.Tensor:
    # q: [1, heads, num_new, head_dim]; keys, values: [1, kv_heads, length, head_dim]
    q4, k4, v4 = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    out = (
        _sdpa(q4, k4, v4, mask, causal, scale) if softcap is None else _attend(q4, k4, v4, mask, causal, scale, softcap)
    )
    return out[0].transpose(0, 1)


def _attend(q, k, v, mask: torch.Tensor | None, causal: bool, scale: float, softcap: float | None) -> torch.Tensor:
    """SDPA, or with ``softcap`` the same attention written out (SDPA has no soft-capping):
    scores capped by ``softcap * tanh(s / softcap)`` before the mask and a float32 softmax,
    as transformers' Gemma 2 computes them. K/V heads may be fewer (grouped) than q's."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    k, v = _repeat_kv(q, k, v)  # (the decode path groups q by K/V head itself)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        n, s = scores.shape[-2:]
        mask = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(s - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def _sdpa(q, k, v, mask: torch.Tensor | None, causal: bool, scale: float) -> torch.Tensor:
    """SDPA with grouped K/V heads repeated up front.

    ``enable_gqa=True`` sends PyTorch's CPU backend down its unfused math path
    (bmm + softmax), 3x slower on a 512-token prefill than the flash kernel that
    plain multi-head inputs get; repeating K/V costs far less. Inputs are 4-D
    ``[batch, heads, tokens, head_dim]``: the fused kernels take nothing else.
    """
    k, v = _repeat_kv(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def _repeat_kv(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped K/V heads repeated to q's heads ([..., heads, tokens, head_dim])."""
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    return k, v
