"""A whole model cut to one rank's shard (``ModelShard``, ``model/shard_plan.py``).

Quantised weights are quantised whole, then cut, so that a rank's int8 scales (per
output row) and int4 groups (along the input) are exactly those of the unsplit
model: a row-parallel shard keeps its rows' full-width scales.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.errors import TokenmillError
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.shard_plan import ModelShard
from tokenmill.quant.weights import (
    INT4_GROUP_SIZES,
    Int4Linear,
    Int8Linear,
    packed_linear,
    quantize_int4,
    quantize_int8,
)


def shard_model(
    full: nn.Module, shard: ModelShard, quantization: str = "none", group_size: int = 32, packed: bool = False
) -> nn.Module:
    """This rank's model, cut from the whole one (built on the CPU, unquantised):
    float tensors are sliced (copies, so the whole model can be freed), linears
    quantised whole and then sliced when ``quantization`` asks for it (``packed``: into the
    native kernels' layout, as ``quantize_model`` packs them in one process)."""
    quantization = "none" if quantization == "auto" else quantization  # split models load dequantised
    cfg = full.config
    local = shard.local_config(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(local, shard)
    model.rotary, model.rotary_local = full.rotary, full.rotary_local
    hd = cfg.head_dim
    q_rows = _rows(shard.q_heads(cfg), hd)
    kv_rows = _rows(shard.kv_heads(cfg), hd)
    qkv_rows = torch.cat([q_rows, cfg.num_heads * hd + kv_rows, (cfg.num_heads + cfg.num_kv_heads) * hd + kv_rows])
    inter = shard.intermediate(cfg)
    gate_up_rows = torch.cat(
        [torch.arange(inter.start, inter.stop), cfg.intermediate_size + torch.arange(inter.start, inter.stop)]
    )
    q_cols = range(q_rows[0].item(), q_rows[-1].item() + 1)

    def cut(linear: nn.Module, rows: torch.Tensor | None = None, cols: range | None = None) -> nn.Module:
        bias = None if linear.bias is None else linear.bias.data  # (column-parallel layers only: qkv)
        return _cut_linear(linear.weight.data, rows, cols, quantization, group_size, bias=bias, packed=packed)

    for j, i in enumerate(shard.layers(cfg)):
        src, dst = full.layers[i], model.layers[j]
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            if hasattr(src, norm):
                getattr(dst, norm).weight = _param(getattr(src, norm).weight)
        if src.self_attn.q_norm is not None:  # per-head norms: the same on every rank
            dst.self_attn.q_norm.weight = _param(src.self_attn.q_norm.weight)
            dst.self_attn.k_norm.weight = _param(src.self_attn.k_norm.weight)
        dst.self_attn.qkv_proj = cut(src.self_attn.qkv_proj, rows=qkv_rows)
        dst.self_attn.o_proj = cut(src.self_attn.o_proj, cols=q_cols)
        if cfg.num_experts:  # every expert's slice of the intermediate columns; the router whole
            dst.mlp.gate.weight = _param(src.mlp.gate.weight)
            dst.mlp.w13 = _param(src.mlp.w13.data.index_select(1, gate_up_rows))
            dst.mlp.w2 = _param(src.mlp.w2.data[:, :, inter.start : inter.stop])
        else:
            dst.mlp.gate_up_proj = cut(src.mlp.gate_up_proj, rows=gate_up_rows)
            dst.mlp.down_proj = cut(src.mlp.down_proj, cols=inter)
    vocab = shard.vocab(cfg)
    embedding = _pad_rows(full.embed_tokens.weight.data, vocab)
    if shard.is_first_stage:
        model.embed_tokens.weight = _param(embedding)
    else:
        model.embed_tokens = None
    if shard.is_last_stage:
        model.norm.weight = _param(full.norm.weight)
        head = full.embed_tokens.weight.data if full.lm_head is None else full.lm_head.weight.data
        if local.tie_word_embeddings and quantization == "none":
            model.lm_head = None  # reads this rank's embedding rows, as the whole model does
        else:
            model.lm_head = _cut_linear(
                head,
                torch.arange(vocab.start, min(vocab.stop, cfg.vocab_size)),
                None,
                quantization,
                group_size,
                pad_rows=len(vocab),
                packed=packed,
            )
    else:
        model.norm = None
        model.lm_head = None
    return model.eval()


def _rows(heads: range, head_dim: int) -> torch.Tensor:
    return torch.arange(heads.start * head_dim, heads.stop * head_dim)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.clone(), requires_grad=False)


def _pad_rows(w: torch.Tensor, rows: range) -> torch.Tensor:
    """w[rows], zero rows past the end (the vocabulary's padding on the last rank)."""
    out = w.new_zeros(len(rows), w.shape[1])
    real = w[rows.start : min(rows.stop, w.shape[0])]
    out[: real.shape[0]] = real
    return out


def _cut_linear(
    w: torch.Tensor,
    rows: torch.Tensor | None,
    cols: range | None,
    quantization: str,
    group_size: int,
    pad_rows: int | None = None,
    bias: torch.Tensor | None = None,
    packed: bool = False,
) -> nn.Module:
    """A linear layer holding w[rows][:, cols] (quantised as the whole w would be),
    with zero rows appended up to ``pad_rows``, and bias[rows]."""
    if bias is not None:
        assert cols is None, "a row-parallel layer's bias would be added once per rank"
        bias = (bias if rows is None else bias.index_select(0, rows)).clone()

    def take(t: torch.Tensor, row_dim: int = 0, col_dim: int = 1) -> torch.Tensor:
        if rows is not None:
            t = t.index_select(row_dim, rows)
        if cols is not None:
            t = t.narrow(col_dim, cols.start, len(cols))
        if pad_rows is not None and t.shape[row_dim] < pad_rows:
            shape = list(t.shape)
            shape[row_dim] = pad_rows - t.shape[row_dim]
            t = torch.cat([t, t.new_zeros(shape)], dim=row_dim)
        return t.contiguous()

    k = w.shape[1]
    width = k if cols is None else len(cols)
    if quantization == "int4" and not k % group_size and not width % group_size and group_size in INT4_GROUP_SIZES:
        if cols is not None and cols.start % group_size:
            raise TokenmillError(
                f"int4 groups of {group_size} do not align with a shard starting at column {cols.start}"
            )
        q, scales_and_zeros = quantize_int4(w, group_size)  # [N, K], [K/G, N, 2]
        group_cols = None if cols is None else range(cols.start // group_size, cols.stop // group_size)
        sz = scales_and_zeros if rows is None else scales_and_zeros.index_select(1, rows)
        if group_cols is not None:
            sz = sz.narrow(0, group_cols.start, len(group_cols))
        if pad_rows is not None and sz.shape[1] < pad_rows:
            sz = torch.cat([sz, sz.new_zeros(sz.shape[0], pad_rows - sz.shape[1], 2)], dim=1)  # padding: 0
        if packed:  # w = (q - 8) s + z = q s + (z - 8 s), as quantize_model packs it
            s, z = sz[..., 0].T, sz[..., 1].T
            layer = packed_linear(take(q), s, z - 8 * s, 4, group_size, bias)
            if layer is not None:
                return layer
        return Int4Linear(take(q), sz.contiguous(), group_size, bias)
    if quantization in ("int8", "int4"):  # int4 that the group does not divide: int8, as quantize_model does
        q, scales = quantize_int8(w)
        s = scales if rows is None else scales.index_select(0, rows)
        if pad_rows is not None and s.shape[0] < pad_rows:
            s = torch.cat([s, s.new_ones(pad_rows - s.shape[0])])
        layer = packed_linear(take(q), s[:, None], None, 8, width, bias) if packed else None
        return layer if layer is not None else Int8Linear(take(q), s, w.dtype, bias)
    linear = nn.Linear(
        width, pad_rows or (len(rows) if rows is not None else w.shape[0]), bias=bias is not None, device="meta"
    )
    linear.weight = _param(take(w))
    if bias is not None:
        linear.bias = _param(bias)
    return linear
