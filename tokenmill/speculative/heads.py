"""Speculative heads: small networks over the target's own hidden states.

**EAGLE** (Li et al. 2024; EAGLE-2 drafts with the same head) drafts at the feature
level: at position p it takes the target's final hidden state f_p and the embedding
of the next token t_(p+1), fuses them (``fc``: 2h -> h), and runs one decoder layer
(with its own paged K/V) to predict f_(p+1); an LM head turns that into t_(p+2). The
next draft feeds the predicted feature back with the drafted token. The LM head is
the target's, or a smaller one over a *draft vocabulary* (``lm_head`` with ``d2t``,
EAGLE-3's names: draft id i is target id ``i + d2t[i]``), which is what makes a head
cheap next to a 135M model whose LM head is a fifth of its weights.

**Medusa** (Cai et al. 2024): K heads over the last hidden state, head i a residual
block (``x + SiLU(W x + b)``) and its own LM head, predicting t_(p+2+i) at once.

Checkpoints load in their published layouts: an EAGLE folder (``config.json``, a
Llama config with one layer, and ``model.safetensors`` or ``pytorch_model.bin`` with
``fc.*`` and ``layers.0.*``; its first layer has no input norm) and a Medusa folder
(``config.json`` with ``medusa_num_heads`` / ``medusa_num_layers`` and
``medusa_lm_head.safetensors`` or ``.pt`` with ``{head}.{block}.linear.*`` and
``{head}.{medusa_num_layers}.weight``). A head's ``embed_tokens.weight``, which some
EAGLE checkpoints carry, is the target's own table and is not loaded twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from tokenmill.configuration.config import ModelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.model.layers.attention import AttentionMetadata
from tokenmill.model.layers.kv_cache import KVCacheLayer
from tokenmill.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from tokenmill.model.loader import hf_config

HEADS = ("eagle", "medusa")  # the speculative methods that read the target's hidden states
EAGLE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# The EAGLE head `tokenmill train-draft` made for the default model (bench/RESULTS.md has the command).
BUNDLED_EAGLE = Path(__file__).parent / "bundled" / "smollm2-135m-instruct-eagle"
MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors")


def head_path(method: str, draft_model: str | None, model: str | None) -> Path:
    """The head's folder: ``draft_model``, or for EAGLE on the default model the bundled head."""
    if draft_model is not None:
        return Path(draft_model).expanduser()
    from tokenmill.model.paths import default_model_path, resolve_model_path

    if method == "eagle" and resolve_model_path(model).resolve() == default_model_path().resolve():
        if not (BUNDLED_EAGLE / "config.json").exists():
            raise ModelLoadError(f"the bundled EAGLE head is missing from {BUNDLED_EAGLE}")
        return BUNDLED_EAGLE
    raise ModelLoadError(
        f"speculative method {method!r} needs its head's folder (--draft-model): only the default "
        "model has a bundled EAGLE head; `tokenmill train-draft` makes one for another"
    )


def _read_weights(path: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    for name in names:
        f = path / name
        if f.exists():
            if f.suffix == ".safetensors":
                from safetensors.torch import load_file

                return load_file(str(f))
            return torch.load(f, map_location="cpu", weights_only=True)
    raise ModelLoadError(f"{path}: no head weights (looked for {', '.join(names)})")


def _read_json(path: Path) -> dict:
    f = path / "config.json"
    if not f.exists():
        raise ModelLoadError(f"{path}: no config.json")
    return json.loads(f.read_text())


# ------------------------------------------------------------------------ EAGLE


@dataclass(frozen=True)
class EagleConfig:
    layer: ModelConfig  # the head's decoder layer (one layer, the target's widths)
    fc_bias: bool
    draft_vocab_size: int | None  # None: the target's LM head drafts


class EagleHead(nn.Module):
    """The serving form: the decoder layer is ours (fused q/k/v and gate/up, paged K/V,
    the target's per-layer ops), so drafting runs the kernels a target layer runs."""

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        h = cfg.layer.hidden_size
        self.config = cfg
        self.fc = nn.Linear(2 * h, h, bias=cfg.fc_bias)
        self.layer = LlamaDecoderLayer(cfg.layer)
        self.lm_head = None if cfg.draft_vocab_size is None else nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target", torch.zeros(0, dtype=torch.long), persistent=False)

    def forward(
        self,
        target: LlamaForCausalLM,
        features: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCacheLayer,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """features [n, h] (f_p), next_ids [n] (t_(p+1)), at positions p -> predicted f_(p+1)."""
        x = self.fc(torch.cat([target._embed(next_ids).to(features.dtype), features], dim=-1))
        assert target.rotary is not None
        return self.layer(x, x.clone(), positions, target.rotary, kv_cache, meta, target.ops, next_norm=None)

    def logits(self, target: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """[n, vocab] float32: the target's LM head, or the draft vocabulary's scattered
        into the target's (every other token -inf: the draft never proposes it)."""
        if self.lm_head is None:
            return target.compute_logits(hidden)
        small = self.lm_head(hidden).float()
        full = small.new_full((hidden.shape[0], target.config.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = small
        return full


def eagle_config(path: Path, target: ModelConfig) -> tuple[EagleConfig, dict]:
    raw = _read_json(path)
    arch = " ".join(raw.get("architectures") or [])
    if "Eagle3" in arch or "midlayer" in json.dumps(raw):
        raise ModelLoadError(
            f"{path}: an EAGLE-3 head (fused low/mid/high features) is not supported yet; EAGLE-1/2 heads are"
        )
    layer = hf_config({**raw, "model_type": raw.get("model_type", "llama")}, path)
    if layer.num_layers != 1:
        raise ModelLoadError(f"{path}: an EAGLE head of {layer.num_layers} layers; one is supported")
    if layer.hidden_size != target.hidden_size:
        raise ModelLoadError(
            f"{path}: an EAGLE head of width {layer.hidden_size} for a target of width "
            f"{target.hidden_size}: it was trained for another model"
        )
    draft_vocab = raw.get("draft_vocab_size")
    cfg = EagleConfig(
        replace(layer, rope_theta=target.rope_theta) if "rope_theta" not in raw else layer,
        bool(raw.get("bias", False)),
        int(draft_vocab) if draft_vocab else None,
    )
    return cfg, raw


def load_eagle(path: str | Path, target: LlamaForCausalLM) -> EagleHead:
    """An EAGLE-1/2 head folder, checked against the target, in the target's dtype and device."""
    path = Path(path)
    cfg, _ = eagle_config(path, target.config)
    weights = {k.removeprefix("model."): v for k, v in _read_weights(path, EAGLE_WEIGHTS).items()}
    weights.pop("embed_tokens.weight", None)  # the target's own table
    cfg = replace(cfg, fc_bias="fc.bias" in weights)
    if "lm_head.weight" in weights and cfg.draft_vocab_size is None:
        cfg = replace(cfg, draft_vocab_size=weights["lm_head.weight"].shape[0])
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)  # the inverse map, derived from d2t when needed
    if cfg.draft_vocab_size is not None and d2t is None:
        raise ModelLoadError(f"{path}: a draft LM head of {cfg.draft_vocab_size} tokens without its d2t map")
    layer_weights = _fuse_layer(
        {k.removeprefix("layers.0."): v for k, v in weights.items() if k.startswith("layers.0.")}
    )
    state = {f"layer.{k}": v for k, v in layer_weights.items()}
    state.setdefault("layer.input_layernorm.weight", torch.ones(cfg.layer.hidden_size))  # EAGLE's first layer: none
    state.update({k: v for k, v in weights.items() if not k.startswith("layers.")})
    head = EagleHead(cfg)
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise ModelLoadError(f"{path}: the head's tensors do not fit: {e}") from None
    if missing or unexpected:
        raise ModelLoadError(
            f"{path}: the head's tensors do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if d2t is not None:
        ids = torch.arange(len(d2t)) + d2t.long()
        if len(d2t) != cfg.draft_vocab_size or int(ids.max()) >= target.config.vocab_size or int(ids.min()) < 0:
            raise ModelLoadError(
                f"{path}: its d2t map does not fit the target's vocabulary of {target.config.vocab_size}"
            )
        head.draft_to_target = ids
    ref = target.layers[0].input_layernorm.weight
    return head.to(device=ref.device, dtype=ref.dtype).eval()


def _fuse_layer(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q/k/v and gate/up of one layer's published names -> our fused names."""
    w = dict(w)
    for parent, names, into in (
        ("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
        ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"),
    ):
        if f"{parent}.{into}.weight" in w:
            continue
        keys = [f"{parent}.{n}.weight" for n in names]
        missing = [k for k in keys if k not in w]
        if missing:
            raise ModelLoadError(f"an EAGLE layer without {missing}")
        w[f"{parent}.{into}.weight"] = torch.cat([w.pop(k) for k in keys])
        if f"{parent}.{names[0]}.bias" in w:
            w[f"{parent}.{into}.bias"] = torch.cat([w.pop(f"{parent}.{n}.bias") for n in names])
    return w


def native_head_linears(head: EagleHead) -> None:
    """The head's float linears on the native small-batch kernel, as the target's are."""
    from tokenmill.kernels.linear import NativeLinear
    from tokenmill.quant.weights import linear_layers

    def swap(linear: nn.Linear) -> NativeLinear:
        return NativeLinear(linear.weight, None, linear.bias)

    for parent, name in linear_layers(head.layer):
        setattr(parent, name, swap(getattr(parent, name)))
    head.fc = swap(head.fc)
    if head.lm_head is not None:
        head.lm_head = swap(head.lm_head)


# ----------------------------------------------------------------------- Medusa


class ResBlock(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.linear = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads; head i: ``num_layers`` residual blocks then a bias-free LM head. Named as
    the Medusa repository saves them (``{i}.{j}.linear.*``, ``{i}.{num_layers}.weight``)."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int = 1) -> None:
        super().__init__()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)], nn.Linear(hidden, vocab, bias=False))
            for _ in range(num_heads)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, h] -> [num_heads, n, vocab] float32 logits (head i: the token i + 2 ahead)."""
        return torch.stack([head(hidden).float() for head in self.heads])

    def published_state(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix("heads."): v for k, v in self.state_dict().items()}


def load_medusa(path: str | Path, target: LlamaForCausalLM) -> MedusaHeads:
    path = Path(path)
    raw = _read_json(path)
    if "medusa_num_heads" not in raw:
        raise ModelLoadError(f"{path}: config.json has no medusa_num_heads: not a Medusa head")
    num_heads, num_layers = int(raw["medusa_num_heads"]), int(raw.get("medusa_num_layers", 1))
    weights = _read_weights(path, MEDUSA_WEIGHTS)
    first = weights.get(f"0.{num_layers}.weight")
    if first is None:
        raise ModelLoadError(f"{path}: no 0.{num_layers}.weight: not the Medusa layout")
    vocab, hidden = first.shape
    if hidden != target.config.hidden_size or vocab != target.config.vocab_size:
        raise ModelLoadError(
            f"{path}: Medusa heads of width {hidden} over {vocab} tokens for a target of width "
            f"{target.config.hidden_size} over {target.config.vocab_size}"
        )
    heads = MedusaHeads(hidden, vocab, num_heads, num_layers)
    try:
        missing, unexpected = heads.load_state_dict({f"heads.{k}": v for k, v in weights.items()}, strict=False)
    except RuntimeError as e:
        raise ModelLoadError(f"{path}: the Medusa tensors do not fit: {e}") from None
    if missing or unexpected:
        raise ModelLoadError(
            f"{path}: the Medusa tensors do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    ref = target.layers[0].input_layernorm.weight
    return heads.to(device=ref.device, dtype=ref.dtype).eval()
