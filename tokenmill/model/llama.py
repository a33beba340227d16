"""The Llama-family decoder: Llama 2/3 and SmolLM2, Mistral (sliding-window attention),
Mixtral (experts, ``layers/moe.py``), Qwen2/2.5 (biases on q, k, v), Qwen3 (per-head q/k
RMSNorm), Phi-3 (LongRoPE) and Gemma 2/3 (GeGLU, sandwich norms, soft-capping, local and
global layers), as switches of one ``ModelConfig`` rather than copies of this file.

Every input is an explicit forward argument: the flat token batch, absolute
positions, one paged K/V cache (KVCacheLayer) per layer, and the attention metadata. The
model knows nothing of requests; it maps tokens to hidden states and hidden states
to logits.

Split across ranks (``ModelShard``, ``model/shard_plan.py``), a model holds its heads,
columns, vocabulary rows and layers; its ``tp`` group adds the partial sums of the
row-parallel projections and of the vocabulary-parallel embedding. A pipeline stage
that is not the first takes the previous stage's residual stream instead of token
ids, and one that is not the last returns its residual stream instead of the final
norm's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from tokenmill.configuration.config import ModelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.lora.layers import LoRAMapping
from tokenmill.model.layers.attention import AttentionMetadata
from tokenmill.model.layers.kv_cache import KVCacheLayer
from tokenmill.model.layers.moe import MoEMLP, stack_experts
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.rotary import RotaryEmbedding, rotary_for
from tokenmill.model.ops import TorchOps
from tokenmill.model.shard_plan import ModelShard
from tokenmill.quant.blocks import BlockWeight
from tokenmill.quant.packed import PackedWeight, QuantEmbedding, QuantLinear

KVCache = KVCacheLayer


class TensorParallelGroup(Protocol):
    """The ranks of one pipeline stage (``distributed/groups.py``)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...  # sum over the ranks, in place


def project(
    linear: nn.Module, x: torch.Tensor, lora: LoRAMapping | None, long_rows: tuple[tuple[int, int], ...] | None
) -> torch.Tensor:
    """A projection, with this step's LoRA rows when there are any (then ``linear`` is a
    LoRALinear: the mapping reaches it as an argument, never as module state). ``long_rows``
    (``TorchOps.long_rows``) reaches a linear over GGUF blocks, its own or a LoRALinear's base."""
    if long_rows is None or not isinstance(getattr(linear, "base", linear), QuantLinear):
        return linear(x) if lora is None else linear(x, lora)
    return linear(x, long_rows=long_rows) if lora is None else linear(x, lora, long_rows=long_rows)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.query_scale or self.head_dim**-0.5
        self.softcap = cfg.attn_softcap
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # Q, K and V in one matmul (one read of the activations, one bigger GEMM).
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        # Qwen3: each head's q and k normalised (over head_dim) before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.window = cfg.window_of(layer)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        ops: TorchOps,
        tp: TensorParallelGroup | None = None,
        lora: LoRAMapping | None = None,
        long_rows: tuple[tuple[int, int], ...] | None = None,  # ops.long_rows(meta), the layer's
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = project(self.qkv_proj, x, lora, long_rows).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = ops.rms_norm(q.reshape(-1, self.head_dim), self.q_norm.weight, self.q_norm.eps).view_as(q)
            k = ops.rms_norm(k.reshape(-1, self.head_dim), self.k_norm.weight, self.k_norm.eps).view_as(k)
        q, k = ops.rotary_write_kv(q, k, v, positions, rotary, kv_cache, meta.slot_mapping)
        if meta.query_rows is not None:
            meta.kept_queries.append(q.index_select(0, meta.query_rows).float())
        out = ops.attention(q, k, v, kv_cache, meta, self.scale, self.window, self.softcap)
        out = project(self.o_proj, out.reshape(n, -1), lora, long_rows)
        return out if tp is None else tp.all_reduce(out)  # row-parallel: partial sums


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gelu = cfg.hidden_act == "gelu_tanh"  # GeGLU (Gemma) instead of SwiGLU
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        ops: TorchOps,
        tp: TensorParallelGroup | None = None,
        lora: LoRAMapping | None = None,
        long_rows: tuple[tuple[int, int], ...] | None = None,
    ) -> torch.Tensor:
        gate_up = project(self.gate_up_proj, x, lora, long_rows)
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            h = nn.functional.gelu(gate, approximate="tanh") * up
        else:
            h = ops.silu_mul(gate_up)
        out = project(self.down_proj, h, lora, long_rows)
        return out if tp is None else tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks around a residual stream.

    The residual add is fused into the next norm: the layer takes the already
    normalised input ``h`` and the residual stream ``x`` (updated in place), and
    returns the next norm's output (``next_norm``: the next layer's input norm, or
    the model's final norm; None at the end of a pipeline stage: then it returns the
    residual stream itself, which the next stage takes)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer)
        # Llama: the pre-MLP norm. Gemma (sandwich norms): the attention output's norm,
        # with pre_feedforward_layernorm before the MLP and post_feedforward_layernorm after it.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoEMLP(cfg) if cfg.num_experts else LlamaMLP(cfg)

    def forward(
        self,
        h,
        x,
        positions,
        rotary,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        ops: TorchOps,
        next_norm: RMSNorm | None,
        tp: TensorParallelGroup | None = None,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        post = self.post_attention_layernorm
        long_rows = ops.long_rows(meta)  # the rows that may take a GGUF weight's GEMM (once a layer)
        attn = self.self_attn(h, positions, rotary, kv_cache, meta, ops, tp, lora, long_rows)
        if self.sandwich:
            attn = ops.rms_norm(attn, post.weight, post.eps)
            post = self.pre_feedforward_layernorm
        h = ops.add_rms_norm(attn, x, post.weight, post.eps)
        if isinstance(self.mlp, LlamaMLP):
            out = self.mlp(h, ops, tp, lora, long_rows)
        else:
            out = self.mlp(h, ops, tp)  # no adapters on experts
        if self.sandwich:
            out = ops.rms_norm(out, self.post_feedforward_layernorm.weight, self.post_feedforward_layernorm.eps)
        if next_norm is None:
            return x.add_(out)
        return ops.add_rms_norm(out, x, next_norm.weight, next_norm.eps)


@dataclass
class FusedPlan:
    """A plain decoder's tensors in the order ``decode_layers`` (kernels/csrc/decode_loop.cpp)
    reads them: per layer the post-attention norm, the next norm, and 3 tensors per linear
    (qkv, o, gate_up, down); ``kinds``: (bits, group) per linear, bits 0 for a float weight (its
    group 1 where one row takes the tiles, not one stream: NativeLinear.one_stream), negative for
    GGUF blocks (csrc/decode_loop.cpp says how)."""

    weights: list[torch.Tensor]
    kinds: list[int]
    scale: float
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    blocks_only: bool  # every linear in GGUF blocks (kinds' bits < 0)
    # the native kernels' handle on these tensors and the caches (model/ops.layer_stack), made at first use
    native_stack: tuple | None = field(default=None, repr=False, compare=False)


def _fused_linear(linear: nn.Module, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[int]] | None:
    """A linear as decode_layers takes it: one packed weight, or a float weight the small-batch
    kernel multiplies as NativeLinear would (the same dtype, or 16 bits kept from the file)."""
    from tokenmill.kernels.linear import NativeLinear

    empty = torch.empty(0)
    if isinstance(linear, QuantLinear) and len(linear.parts) == 1 and linear.bias is None and linear.native:
        p = linear.parts[0]
        if isinstance(p, BlockWeight):
            return [p.qs, empty, empty], [p.bits, 0]
        return [p.qs, p.scale, empty if p.minv is None else p.minv], [p.bits, p.group]
    if (
        isinstance(linear, QuantLinear)
        and len(linear.parts) == 2
        and linear.bias is None
        and linear.native
        and all(isinstance(p, BlockWeight) for p in linear.parts)
    ):
        a, b = linear.parts  # two block types (Q4_K_M's qkv): the second part's blocks and type in the scale's place
        return [a.qs, b.qs, empty], [a.bits, b.type_code]
    sixteen = (torch.float16, torch.bfloat16)
    if (
        type(linear) is NativeLinear
        and linear.bias is None
        and (linear.weight.dtype == dtype or linear.weight.dtype in sixteen)
    ):
        return [linear.weight, empty, empty], [0, 0 if linear.one_stream else 1]
    return None


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ModelShard | None = None) -> None:
        """``cfg``: the shapes this model holds (a shard's ``local_config``)."""
        super().__init__()
        self.config = cfg
        self.shard = shard or ModelShard()
        # the table to adopt the checkpoint's into, uninitialised: Embedding's own random init on the
        # meta device (where models are built) imports torch._dynamo, ~1 s of every load
        self.embed_tokens: nn.Embedding | None = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None  # built in load_weights (needs rope_freqs)
        self.rotary_local: RotaryEmbedding | None = None  # windowed layers' own RoPE base (Gemma 3)
        self.ops: TorchOps = TorchOps()  # the per-layer ops; the factory may swap in native kernels
        self.tp: TensorParallelGroup | None = None  # set when the model is split across ranks
        self.has_lora_slots = False  # set by add_lora_slots (multi-LoRA serving)
        self._fused_plan: FusedPlan | None | bool = False  # False: not looked at yet

    @classmethod
    def from_weights(
        cls, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device | str = "cpu"
    ) -> LlamaForCausalLM:
        """Build without allocating random weights, then adopt the loaded tensors. A
        checkpoint whose tensors do not fit (missing, unexpected, wrong shapes) is refused
        with ``ModelLoadError`` naming them."""
        with torch.device("meta"):
            model = cls(cfg)
        weights = adopt_packed(model, weights)
        try:
            weights = fuse_projections(weights, cfg.num_layers, moe=cfg.num_experts > 0)
            if cfg.num_experts:
                weights = stack_experts(weights, cfg.num_layers, cfg.num_experts)
        except KeyError as e:
            raise ModelLoadError(f"checkpoint does not fit the model: missing tensor {e}") from None
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        freq_factors = weights.pop("rope_freqs", None)
        if cfg.tie_word_embeddings and not isinstance(model.lm_head, QuantLinear):
            weights.pop("lm_head.weight", None)
        try:
            missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
        except RuntimeError as e:  # shapes that do not fit: torch names each tensor
            raise ModelLoadError(f"checkpoint does not fit the model ({cfg.architecture}): {e}") from None
        if missing or unexpected:
            raise ModelLoadError(
                f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        model.rotary = rotary_for(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, freq_factors
        )
        if cfg.rope_local_theta is not None:
            model.rotary_local = rotary_for(cfg.head_dim, cfg.rope_local_theta, None, cfg.max_position_embeddings)
        return model.to(device).eval()

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],  # one per layer run
        meta: AttentionMetadata,
        num_layers: int | None = None,  # run only the first num_layers (self-speculation's draft)
        lora: LoRAMapping | None = None,  # which token rows use which adapter slot
        residual: torch.Tensor | None = None,  # a later pipeline stage: the previous stage's output
    ) -> torch.Tensor:  # [num_tokens, hidden]: final-norm output (last stage) or residual stream
        assert self.rotary is not None
        assert lora is None or self.has_lora_slots, "a LoRA mapping for a model without adapter slots"
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        ops, tp = self.ops, self.tp
        x = self._embed(input_ids) if residual is None else residual  # updated in place by each layer
        first = layers[0].input_layernorm
        h = ops.rms_norm(x, first.weight, first.eps)
        plan = (
            self.fused_plan
            if num_layers is None
            and tp is None
            and residual is None
            and not self.has_lora_slots
            and meta.query_rows is None  # (queries kept: layer by layer)
            else None
        )
        if plan is not None:
            out = ops.decoder_layers(x, h, plan, positions, self.rotary, kv_caches, meta)
            if out is not None:
                return out
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            h = layer(h, x, positions, self._rotary_of(layer), kv_cache, meta, ops, next_norm, tp, lora)
        return h

    def shift_keys(self, kv_caches: list[KVCache], block_ids: list[int], delta: int) -> None:
        """The cached keys in ``block_ids`` moved ``delta`` positions (each layer with its own
        RoPE): the kept keys of a request that evicted tokens before them (``KVEviction``)."""
        if not block_ids:
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].k.device)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            rotary = self._rotary_of(layer)
            cache.rotate_keys(index, lambda k, r=rotary: r.shift(k, delta))

    def _rotary_of(self, layer: LlamaDecoderLayer) -> RotaryEmbedding:
        """A layer's RoPE: windowed layers' own base where the model has one (Gemma 3)."""
        rotary = self.rotary_local if self.rotary_local is not None and layer.self_attn.window else self.rotary
        assert rotary is not None
        return rotary

    def attention_paid(
        self, queries: torch.Tensor, kv_caches: list[KVCache], block_ids: list[int], length: int
    ) -> torch.Tensor:
        """[length] float32: the attention that the queries of a sequence's last tokens
        (``queries``: [layers, observed, heads, head_dim], after RoPE, as ``kept_queries`` holds
        them) pay each of its ``length`` cached tokens, each query's softmax (causal) summed
        over queries, heads and layers: what SnapKV keeps the most of."""
        observed = queries.shape[1]
        bs = kv_caches[0].block_size
        index = torch.tensor(block_ids[: -(-length // bs)], dtype=torch.long, device=kv_caches[0].k.device)
        q_pos = torch.arange(length - observed, length, device=index.device)
        mask = torch.arange(length, device=index.device)[None, :] <= q_pos[:, None]  # [observed, length]
        total = torch.zeros(length, dtype=torch.float32, device=index.device)
        for layer, cache, q in zip(self.layers, kv_caches, queries, strict=True):
            attn = layer.self_attn
            keys = cache.gather(index)[0].flatten(0, 1)[:length].float()  # [length, kv_heads, head_dim]
            kv_heads = keys.shape[1]
            grouped = q.view(observed, kv_heads, -1, q.shape[-1])
            scores = torch.einsum("okgd,lkd->kgol", grouped, keys) * attn.scale
            if attn.softcap is not None:
                scores = torch.tanh(scores / attn.softcap) * attn.softcap
            total += scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).sum(dim=(0, 1, 2))
        return total

    @property
    def keys_shift(self) -> bool:
        """Cached keys can move to other positions (``shift_keys``): no sliding window (its
        mask is by position) and RoPE frequencies that do not depend on the position."""
        cfg = self.config
        return (
            self.rotary is not None
            and self.rotary.shiftable
            and cfg.sliding_window is None
            and not any(cfg.layer_windows or ())
        )

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, "only the first pipeline stage embeds tokens"
        scale = self.config.embedding_scale
        if self.tp is None:
            x = self.embed_tokens(input_ids)
        else:
            rows = self.config.vocab_size  # vocabulary-parallel: this rank owns rows [start, start + rows)
            local = input_ids - self.shard.tp_rank * rows
            outside = (local < 0) | (local >= rows)
            x = self.tp.all_reduce(self.embed_tokens(local.clamp(0, rows - 1)).masked_fill_(outside[:, None], 0))
        x = x.to(self.layers[0].input_layernorm.weight.dtype)  # a table kept in the file's 16 bits
        return x if scale is None else x * torch.tensor(scale, dtype=x.dtype)  # Gemma: in the model's dtype

    @property
    def fused_plan(self) -> FusedPlan | None:
        """This model's tensors for the C++ layer loop, when every layer is the plain Llama
        layer (pre-norm attention, SwiGLU, no biases, q/k norms, windows or soft-capping) and
        every linear has a small-batch kernel; None otherwise. Built once (after the linears
        took their final form: the first forward comes after ``prepare_model``)."""
        if self._fused_plan is False:
            self._fused_plan = self._build_fused_plan()
        return self._fused_plan  # type: ignore[return-value]

    def reset_fused_plan(self) -> None:
        """Called by whatever swaps this model's linears (quantisation, native kernels, LoRA)."""
        self._fused_plan = False

    def _build_fused_plan(self) -> FusedPlan | None:
        cfg = self.config
        if self.rotary_local is not None or self.norm is None or cfg.final_softcap is not None:
            return None
        dtype = self.norm.weight.dtype
        weights: list[torch.Tensor] = []
        kinds: list[int] = []
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if (
                type(mlp) is not LlamaMLP
                or mlp.gelu
                or layer.sandwich
                or attn.q_norm is not None
                or attn.window is not None
                or attn.softcap is not None
            ):
                return None
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            weights += [layer.post_attention_layernorm.weight, next_norm.weight]
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                fused = _fused_linear(linear, dtype)
                if fused is None:
                    return None
                weights += fused[0]
                kinds += fused[1]
        attn = self.layers[0].self_attn
        blocks_only = all(bits < 0 for bits in kinds[::2])
        return FusedPlan(
            weights, kinds, attn.scale, cfg.rms_norm_eps, attn.num_heads, attn.num_kv_heads, attn.head_dim, blocks_only
        )

    @property
    def head_reads_embedding(self) -> bool:
        """True where the LM head multiplies by the embedding table itself (tied, not copied)."""
        if self.lm_head is None:
            return True
        return (
            isinstance(self.lm_head, QuantLinear)
            and isinstance(self.embed_tokens, QuantEmbedding)
            and any(p is self.embed_tokens.weight for p in self.lm_head.parts)
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        """Split by tensor parallelism, these are this rank's vocabulary columns."""
        if self.lm_head is None:  # tied to the embeddings
            assert self.embed_tokens is not None
            logits = nn.functional.linear(hidden, self.embed_tokens.weight).float()
        else:
            logits = project(self.lm_head, hidden, None, self.ops.head_long_rows()).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def adopt_packed(model: LlamaForCausalLM, weights: dict) -> dict:
    """Quantised checkpoint weights (``PackedWeight``) become QuantLinear / QuantEmbedding
    modules in place of the meta-device ones; their tensors join the returned weights under
    the new modules' names, so that loading the state dict sees every tensor. A projection
    fused here whose parts are not all quantised takes them all in float."""
    if not any(isinstance(v, PackedWeight) for v in weights.values()):
        return weights
    weights = dict(weights)
    dtype = weights["norm.weight"].dtype if "norm.weight" in weights else torch.float32

    def install(parent: nn.Module, attr: str, prefix: str, names: list[str]) -> None:
        keys = [f"{prefix}{n}.weight" for n in names]
        if not all(k in weights for k in keys) or not any(isinstance(weights[k], PackedWeight) for k in keys):
            return
        if not all(isinstance(weights[k], PackedWeight) for k in keys):  # mixed: all in float
            for k in keys:
                w = weights[k]
                weights[k] = w.dequantize().to(dtype) if isinstance(w, PackedWeight) else w
            return
        parts = [weights.pop(k) for k in keys]
        biases = [weights.pop(f"{prefix}{n}.bias") for n in names if f"{prefix}{n}.bias" in weights]
        module = QuantLinear(parts, torch.cat(biases) if biases else None)
        setattr(parent, attr, module)
        weights.update({f"{prefix}{attr}.{k}": v for k, v in module.state_dict().items()})

    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for fused, names in (
            ("qkv_proj", ["q_proj", "k_proj", "v_proj"]),
            ("qkv_proj", ["qkv_proj"]),
            ("o_proj", ["o_proj"]),
        ):
            install(attn, fused, f"{p}self_attn.", names)
        if isinstance(mlp, LlamaMLP):
            for fused, names in (
                ("gate_up_proj", ["gate_proj", "up_proj"]),
                ("gate_up_proj", ["gate_up_proj"]),
                ("down_proj", ["down_proj"]),
            ):
                install(mlp, fused, f"{p}mlp.", names)
    embed = weights.get("embed_tokens.weight")
    if isinstance(embed, PackedWeight):
        model.embed_tokens = QuantEmbedding(weights.pop("embed_tokens.weight"), dtype)
        if model.config.tie_word_embeddings:  # the head reads the same blocks
            model.lm_head = QuantLinear([model.embed_tokens.weight])
        weights.update({f"embed_tokens.{k}": v for k, v in model.embed_tokens.state_dict().items()})
    head = weights.get("lm_head.weight")
    if isinstance(head, PackedWeight) and not model.config.tie_word_embeddings:
        model.lm_head = QuantLinear([weights.pop("lm_head.weight")])
    if isinstance(model.lm_head, QuantLinear):
        weights.update({f"lm_head.{k}": v for k, v in model.lm_head.state_dict().items()})
    for k, v in list(weights.items()):  # anything left quantised (not a linear we know): float
        if isinstance(v, PackedWeight):
            weights[k] = v.dequantize().to(dtype)
    return weights


def fuse_projections(weights: dict[str, torch.Tensor], num_layers: int, moe: bool = False) -> dict[str, torch.Tensor]:
    """Checkpoint names (q/k/v_proj, gate/up_proj) -> our fused qkv_proj and gate_up_proj
    (a mixture-of-experts layer's MLP is left to ``stack_experts``). Projections fused
    already (in the checkpoint, as Phi-3's, or as a QuantLinear by ``adopt_packed``) stay."""
    weights = dict(weights)

    def fused(name: str) -> bool:
        return f"{name}.weight" in weights or f"{name}.parts.0.qs" in weights

    for i in range(num_layers):
        p = f"layers.{i}."
        groups = [("self_attn", ["q_proj", "k_proj", "v_proj"], "qkv_proj")]
        groups += [] if moe else [("mlp", ["gate_proj", "up_proj"], "gate_up_proj")]
        for parent, names, into in groups:
            if fused(f"{p}{parent}.{into}"):
                continue
            missing = [f"{p}{parent}.{n}.weight" for n in names if f"{p}{parent}.{n}.weight" not in weights]
            if missing:
                raise ValueError(f"checkpoint does not fit the model: missing {missing}")
            weights[f"{p}{parent}.{into}.weight"] = torch.cat([weights.pop(f"{p}{parent}.{n}.weight") for n in names])
            if f"{p}{parent}.{names[0]}.bias" in weights:
                weights[f"{p}{parent}.{into}.bias"] = torch.cat([weights.pop(f"{p}{parent}.{n}.bias") for n in names])
    return weights
