"""``tokenmill train-draft``: a speculative head for the served model, trained on its own answers.

Self-distillation (EAGLE, Medusa): the target answers chat prompts (``training.data``), and
the head learns to continue what the target computed. Both train on the CPU for small
models and on a GPU where there is one (``--device``).

**EAGLE** is trained with the training-time test of EAGLE-3: the head is unrolled
``--unroll`` steps, each step taking the previous step's predicted feature with the
true next token, attending to the true features before its origin and to its own
earlier steps (exactly the K/V it sees when drafting), so it learns to draft from its
own predictions, not only from the target's. Loss per step: smooth L1 to the target's
feature plus ``--token-loss-weight`` x cross-entropy to the target's token (EAGLE-1's
pair, 0.1 there), weighted 0.8^step.
The LM head is over a *draft vocabulary* (the ``--draft-vocab-size`` tokens the target
says most often), initialised from the target's rows.

**Medusa**: head i's cross-entropy to the token i + 2 ahead; residual blocks start at
zero and LM heads at the target's (as the Medusa paper).

The acceptance curve is measured on a held-out shard as the engine would see it with
greedy drafting of k tokens: with greedy verification the accepted drafts are the
leading run of drafts equal to the target's tokens, and while they are equal the
teacher-forced unroll *is* the drafting run.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.configuration.config import ModelConfig
from tokenmill.model.layers.rotary import RotaryEmbedding
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.speculative.heads import MedusaHeads
from tokenmill.speculative.training.options import TrainOptions

DEPTH_DECAY = 0.8  # loss weight of unrolled step j: DEPTH_DECAY ** j (EAGLE-3)


# ------------------------------------------------------------------ the reference


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.h, self.kv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv * self.d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class _Layer(nn.Module):
    """EAGLE's decoder layer: no input norm (the first layer of the EAGLE repository's)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class EagleReference(nn.Module):
    """The EAGLE head as plain differentiable torch, its parameters named as the EAGLE
    repository saves them: what ``train-draft`` trains and the test reference for the
    serving head (``heads.EagleHead``)."""

    def __init__(self, cfg: ModelConfig, draft_to_target: torch.Tensor | None, fc_bias: bool = True) -> None:
        """``draft_to_target``: the draft vocabulary's target ids (None: the target's LM head drafts)."""
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList([_Layer(cfg)])
        self.lm_head = None if draft_to_target is None else nn.Linear(h, len(draft_to_target), bias=False)
        ids = torch.zeros(0) if draft_to_target is None else draft_to_target
        self.register_buffer("draft_to_target", ids.long(), persistent=False)

    def unroll(
        self,
        features: torch.Tensor,
        embeds: torch.Tensor,
        lengths: torch.Tensor,
        rotary: RotaryEmbedding,
        steps: int,
    ) -> list[torch.Tensor]:
        """features [B, n, h] (f_p), embeds [B, n + steps - 1, h] (of t_(p+1)...): the
        head's predicted features [B, n, h] for each of ``steps`` drafting steps (step j
        at origin p sits at position p + j - 1 and predicts f_(p+j)). Positions past a
        sequence's length are padding."""
        layer, attn = self.layers[0], self.layers[0].self_attn
        B, n, _ = features.shape
        pos = torch.arange(n, device=features.device)
        key_ok = pos[None, :] < lengths[:, None]  # [B, n]
        causal = pos[None, :] <= pos[:, None]  # [query, key]
        mask = causal[None, None] & key_ok[:, None, None, :]  # [B, 1, n, n]
        groups = attn.h // attn.kv
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        feat, outs = features, []
        for j in range(steps):
            x = self.fc(torch.cat([embeds[:, j : j + n], feat], dim=-1))
            q = attn.q_proj(x).view(B, n, attn.h, attn.d).transpose(1, 2)
            k = attn.k_proj(x).view(B, n, attn.kv, attn.d).transpose(1, 2)
            v = attn.v_proj(x).view(B, n, attn.kv, attn.d).transpose(1, 2)
            cos = rotary.cos[pos + j].to(x.dtype)[None, None]
            sin = rotary.sin[pos + j].to(x.dtype)[None, None]
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            scale = attn.d**-0.5
            if j == 0:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            else:  # the true keys up to the origin, then this origin's own earlier steps and this one
                scores = [(q @ keys[0].transpose(-1, -2)) * scale]
                scores[0] = scores[0].masked_fill(~mask, float("-inf"))
                own = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]] + [
                    (q * k).sum(-1, keepdim=True) * scale
                ]
                probs = torch.softmax(torch.cat(scores + own, dim=-1).float(), dim=-1).to(q.dtype)
                o = probs[..., :n] @ values[0]
                for i, vv in enumerate(values[1:] + [v]):
                    o = o + probs[..., n + i : n + i + 1] * vv
            keys.append(k)
            values.append(v)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(B, n, attn.h * attn.d))
            hmid = layer.post_attention_layernorm(x)
            x = x + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(hmid)) * layer.mlp.up_proj(hmid))
            outs.append(x)
            feat = x
        return outs

    def published_state(self) -> dict[str, torch.Tensor]:
        """The EAGLE layout's tensors, with the draft vocabulary's ``d2t`` (EAGLE-3's offsets)."""
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.lm_head is not None:
            ids = self.draft_to_target.cpu()
            state["d2t"] = ids - torch.arange(len(ids))
        return state


# ------------------------------------------------------------------------- data


@dataclass
class Conversation:
    tokens: torch.Tensor  # [n] int64
    answer_start: int
    features: torch.Tensor  # [n, h]


def load_shards(paths: list[Path]) -> list[Conversation]:
    out = []
    for p in paths:
        d = torch.load(p, weights_only=True)
        for t, s, f in zip(d["tokens"], d["answer_start"], d["features"], strict=True):
            out.append(Conversation(torch.tensor(t), s, f))
    return out


def draft_vocabulary(convs: list[Conversation], size: int, vocab: int) -> torch.Tensor:
    """The ``size`` tokens most often in the answers (ascending ids), with the prompts' as
    the tie-breaker: what the target says is what the head must draft."""
    counts = Counter()
    for c in convs:
        counts.update(c.tokens[c.answer_start :].tolist())
    for c in convs:
        counts.update({t: 0 for t in c.tokens[: c.answer_start].tolist()})
    ids = [t for t, _ in counts.most_common(size)]
    rest = (t for t in range(vocab) if t not in set(ids))
    while len(ids) < min(size, vocab):
        ids.append(next(rest))
    return torch.tensor(sorted(ids))


def batches(convs: list[Conversation], batch_size: int, generator: torch.Generator) -> list[list[Conversation]]:
    """Conversations of similar length together (less padding), batches in random order."""
    order = sorted(range(len(convs)), key=lambda i: len(convs[i].tokens))
    groups = [[convs[i] for i in order[a : a + batch_size]] for a in range(0, len(order), batch_size)]
    perm = torch.randperm(len(groups), generator=generator).tolist()
    return [groups[i] for i in perm]


def _pad(batch: list[Conversation], steps: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    n = max(len(c.tokens) for c in batch)
    B, h = len(batch), batch[0].features.shape[1]
    tokens = torch.zeros(B, n + steps + 1, dtype=torch.long)
    feats = torch.zeros(B, n, h)
    lengths = torch.tensor([len(c.tokens) for c in batch])
    starts = torch.tensor([c.answer_start for c in batch])
    for i, c in enumerate(batch):
        tokens[i, : len(c.tokens)] = c.tokens
        feats[i, : len(c.tokens)] = c.features.float()
    return tokens.to(device), feats.to(device), lengths.to(device), starts.to(device)


# ------------------------------------------------------------------- the losses


def eagle_losses(
    head: EagleReference,
    target: LlamaForCausalLM,
    batch: list[Conversation],
    steps: int,
    device: torch.device,
    target_to_draft: torch.Tensor,
    token_weight: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, accepted [steps] counts of leading correct drafts summed over answer origins, and
    the origin count last): step j at origin p predicts f_(p+j) and t_(p+j+1)."""
    tokens, feats, lengths, starts = _pad(batch, steps, device)
    B, n, _ = feats.shape
    with torch.no_grad():
        embeds = target._embed(tokens[:, 1 : n + steps].reshape(-1)).float().view(B, n + steps - 1, -1)
    assert target.rotary is not None
    outs = head.unroll(feats, embeds, lengths, target.rotary, steps)
    pos = torch.arange(n, device=device)[None, :]
    loss = feats.new_zeros(())
    run = torch.ones(B, n, dtype=torch.bool, device=device)
    accepted = torch.zeros(steps + 1)
    origin = (pos + 1 >= starts[:, None]) & (pos + 2 < lengths[:, None])  # t_(p+2) is in the answer
    accepted[steps] = origin.sum().item()
    for j, out in enumerate(outs):
        f_ok = pos + j + 1 < lengths[:, None]
        t_ok = (pos + j + 2 < lengths[:, None]) & (pos + j + 2 >= starts[:, None])
        target_feat = torch.zeros_like(feats)
        target_feat[:, : n - j - 1] = feats[:, j + 1 :]
        vloss = F.smooth_l1_loss(out[f_ok], target_feat[f_ok]) if f_ok.any() else loss
        want = tokens[:, j + 2 : j + 2 + n]
        draft_ids = target_to_draft[want]
        ce_ok = t_ok & (draft_ids >= 0)
        assert head.lm_head is not None, "train-draft trains a draft vocabulary"
        logits = head.lm_head(out[ce_ok])
        ploss = F.cross_entropy(logits, draft_ids[ce_ok]) if ce_ok.any() else loss
        loss = loss + DEPTH_DECAY**j * (vloss + token_weight * ploss)
        with torch.no_grad():
            full = torch.zeros(B, n, dtype=torch.bool, device=device)
            if ce_ok.any():
                full[ce_ok] = head.draft_to_target[logits.argmax(-1)] == want[ce_ok]
            run &= full & t_ok
            accepted[j] = (run & origin).sum().item()
    return loss, accepted


def medusa_losses(
    heads: MedusaHeads, batch: list[Conversation], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, feats, lengths, starts = _pad(batch, heads.num_heads, device)
    B, n, _ = feats.shape
    pos = torch.arange(n, device=device)[None, :]
    origin = (pos + 1 >= starts[:, None]) & (pos + 2 < lengths[:, None])
    loss = feats.new_zeros(())
    run = torch.ones(B, n, dtype=torch.bool, device=device)
    accepted = torch.zeros(heads.num_heads + 1)
    accepted[-1] = origin.sum().item()
    for i, head in enumerate(heads.heads):
        ok = (pos + i + 2 < lengths[:, None]) & (pos + i + 2 >= starts[:, None])
        want = tokens[:, i + 2 : i + 2 + n]
        logits = head(feats[ok])
        loss = loss + DEPTH_DECAY**i * F.cross_entropy(logits.float(), want[ok])
        with torch.no_grad():
            hit = torch.zeros(B, n, dtype=torch.bool, device=device)
            hit[ok] = logits.argmax(-1) == want[ok]
            run &= hit
            accepted[i] = (run & origin).sum().item()
    return loss, accepted


# ----------------------------------------------------------------- the training


class Progress:
    """One line on stderr, redrawn: step, epoch, loss, rate, ETA."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.enabled, self.start = total, enabled, time.time()

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        elapsed = time.time() - self.start
        eta = elapsed / max(step, 1) * (self.total - step)
        bar = "#" * int(30 * step / max(self.total, 1))
        sys.stderr.write(f"\r[{bar:<30}] {step}/{self.total} {text} eta {eta:.0f}s ")
        sys.stderr.flush()
        if step >= self.total:
            sys.stderr.write("\n")


def build_head(method: str, target: LlamaForCausalLM, convs: list[Conversation], opts: TrainOptions) -> nn.Module:
    cfg = target.config
    if method == "medusa":
        heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, opts.medusa_heads)
        rows = _dequantized_rows(target, torch.arange(cfg.vocab_size))
        with torch.no_grad():
            for head in heads.heads:
                head[0].linear.weight.zero_()
                head[0].linear.bias.zero_()
                head[-1].weight.copy_(rows)
        return heads
    layer = replace(cfg, num_layers=1)
    ids = draft_vocabulary(convs, opts.draft_vocab_size, cfg.vocab_size)
    head = EagleReference(layer, ids)
    gen = torch.Generator().manual_seed(opts.seed)
    for name, p in head.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02, generator=gen)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
    with torch.no_grad():
        head.lm_head.weight.copy_(_dequantized_rows(target, ids))
    return head


def _dequantized_rows(target: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The target's LM head rows for ``ids`` in float32 (a tied head: the embedding rows)."""
    if target.lm_head is not None and not target.config.tie_word_embeddings:
        eye = torch.eye(target.config.hidden_size, dtype=target.layers[0].input_layernorm.weight.dtype)
        with torch.no_grad():
            return target.lm_head(eye).float().t()[ids]
    with torch.no_grad():
        return target._embed(ids).float()


def save_head(
    head: nn.Module,
    method: str,
    target: ModelConfig,
    out: Path,
    dtype: torch.dtype = torch.bfloat16,
    extra: dict | None = None,
) -> None:
    """The published layout: an EAGLE folder (config.json + model.safetensors) or a
    Medusa folder (config.json + medusa_lm_head.safetensors)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    if method == "medusa":
        assert isinstance(head, MedusaHeads)
        state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.published_state().items()}
        save_file(state, str(out / "medusa_lm_head.safetensors"))
        config = {
            "medusa_num_heads": head.num_heads,
            "medusa_num_layers": head.num_layers,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
        }
    else:
        assert isinstance(head, EagleReference)
        state = head.published_state()
        state = {k: (v.cpu() if k == "d2t" else v.to("cpu", dtype)).contiguous() for k, v in state.items()}
        save_file(state, str(out / "model.safetensors"))
        config = {
            "architectures": ["LlamaForCausalLMEagle"],
            "model_type": "llama",
            "bias": head.fc.bias is not None,
            "hidden_size": target.hidden_size,
            "intermediate_size": target.intermediate_size,
            "num_attention_heads": target.num_heads,
            "num_key_value_heads": target.num_kv_heads,
            "head_dim": target.head_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": target.rms_norm_eps,
            "rope_theta": target.rope_theta,
            "max_position_embeddings": target.max_position_embeddings,
            "vocab_size": target.vocab_size,
            "draft_vocab_size": len(head.draft_to_target),
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        }
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config.update(extra or {})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def train(
    method: str,
    target: LlamaForCausalLM,
    train_convs: list[Conversation],
    eval_convs: list[Conversation],
    opts: TrainOptions,
    out: Path,
    device: torch.device,
    progress: bool = True,
) -> dict:
    """Train (resuming from ``out/train_state.pt`` when there is one), evaluate every
    ``eval_every`` steps, save the head in its published layout at each evaluation and
    at the end; returns the history (loss, acceptance by depth, tokens seen)."""
    torch.manual_seed(opts.seed)
    state_path = out / "train_state.pt"
    head = build_head(method, target, train_convs, opts).to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(opts.seed)
    per_epoch = math.ceil(len(train_convs) / opts.batch_size)
    total = max(1, int(opts.epochs * per_epoch))
    history = {"step": [], "tokens": [], "loss": [], "eval": []}
    step, tokens_seen = 0, 0
    if state_path.exists():
        saved = torch.load(state_path, weights_only=False)
        head.load_state_dict(saved["head"])
        if "draft_to_target" in saved:
            head.draft_to_target = saved["draft_to_target"].to(device)
        optim.load_state_dict(saved["optim"])
        step, tokens_seen, history = saved["step"], saved["tokens"], saved["history"]
        gen.set_state(saved["gen"])
    target_to_draft = None
    if method == "eagle":
        target_to_draft = torch.full((target.config.vocab_size,), -1, dtype=torch.long, device=device)
        target_to_draft[head.draft_to_target] = torch.arange(len(head.draft_to_target), device=device)

    def lr_at(s: int) -> float:
        warm = max(1, total // 20)
        return opts.lr * min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))

    def losses(batch: list[Conversation]) -> tuple[torch.Tensor, torch.Tensor]:
        if method == "eagle":
            assert target_to_draft is not None
            return eagle_losses(head, target, batch, opts.unroll, device, target_to_draft, opts.token_loss_weight)
        return medusa_losses(head, batch, device)

    def evaluate() -> list[float]:
        head.eval()
        acc = None
        with torch.no_grad():
            for b in batches(eval_convs, opts.batch_size, torch.Generator().manual_seed(0)):
                _, a = losses(b)
                acc = a if acc is None else acc + a
        head.train()
        assert acc is not None
        return (acc[:-1] / acc[-1].clamp(min=1)).tolist()  # share of origins whose drafts 1..j all hit

    bar = Progress(total, progress)
    order: list[list[Conversation]] = []
    while step < total:
        if not order:
            order = batches(train_convs, opts.batch_size, gen)
        batch = order.pop()
        for g in optim.param_groups:
            g["lr"] = lr_at(step)
        loss, _ = losses(batch)
        optim.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(params, 0.5)
        optim.step()
        step += 1
        tokens_seen += sum(len(c.tokens) - c.answer_start for c in batch)
        history["step"].append(step)
        history["tokens"].append(tokens_seen)
        history["loss"].append(float(loss))
        if step % opts.eval_every == 0 or step == total:
            history["eval"].append({"step": step, "tokens": tokens_seen, "depth_hit": evaluate()})
            save_head(head, method, target.config, out)
            torch.save(
                {
                    "head": head.state_dict(),
                    "optim": optim.state_dict(),
                    "step": step,
                    "tokens": tokens_seen,
                    "history": history,
                    "gen": gen.get_state(),
                    "draft_to_target": getattr(head, "draft_to_target", None),
                },
                state_path,
            )
        last = history["eval"][-1]["depth_hit"] if history["eval"] else []
        bar.update(
            step,
            f"loss {float(loss):.3f} " + (f"hit@1..{len(last)} " + "/".join(f"{x:.2f}" for x in last) if last else ""),
        )
    (out / "history.json").write_text(json.dumps(history) + "\n")
    return history


def plot(history: dict, out: Path, title: str) -> Path:
    """Loss over steps and the held-out mean accepted length over training tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(history["step"], history["loss"], lw=0.6)
    a.set_xlabel("step")
    a.set_ylabel("training loss")
    a.set_yscale("log")
    ev = history["eval"]
    if ev:
        toks = [e["tokens"] for e in ev]
        b.plot(toks, [1 + sum(e["depth_hit"]) for e in ev], marker="o", label="mean tokens per step (greedy chain)")
        for d in range(len(ev[0]["depth_hit"])):
            b.plot(toks, [e["depth_hit"][d] for e in ev], lw=0.8, label=f"drafts 1..{d + 1} all accepted")
        b.set_xlabel("training answer tokens")
        b.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path = out / "training.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------ the command


def read_prompts(path: str | None, count: int) -> list[str]:
    """One prompt per line of ``path`` (blank lines skipped), or the bundled chat prompts."""
    from tokenmill.speculative.training_prompts import bundled_chat_prompts

    if path is None:
        return bundled_chat_prompts(count)
    lines = [ln.strip() for ln in Path(path).read_text().splitlines()]
    prompts = [ln for ln in lines if ln]
    if not prompts:
        raise ValueError(f"{path} holds no prompts (one per line)")
    return prompts[:count]


def train_draft(
    llm,
    method: str,
    output: str,
    texts: list[str],
    max_tokens: int = 256,
    opts: TrainOptions | None = None,
    progress: bool = True,
) -> Path:
    """Generate (or resume) the self-distillation data with ``llm`` (an ``LLM`` over the
    target model, made by the caller: this package sits below the offline API), train,
    save the head and its plot under ``output``; returns the head's folder (``output/head``)."""
    from tokenmill.speculative.training.data import collect

    opts = opts or TrainOptions(method=method)
    out = Path(output).expanduser()
    started, made = time.time(), [0]

    def report(done: int, total: int, tokens: int) -> None:
        made[0] += tokens
        if progress:
            print(
                f"data: {done}/{total} prompts answered, {made[0]} new answer tokens, {time.time() - started:.0f}s",
                file=sys.stderr,
                flush=True,
            )

    shards = collect(llm, texts, out / "data", max_tokens, on_shard=report)
    convs = load_shards(shards)
    held = max(1, len(convs) // 16)
    train_convs, eval_convs = convs[:-held], convs[-held:]
    if progress:
        n = sum(len(c.tokens) - c.answer_start for c in train_convs)
        print(
            f"training a {method} head on {len(train_convs)} answers ({n} tokens), {len(eval_convs)} held out",
            file=sys.stderr,
            flush=True,
        )
    target = llm.model
    dev = next(target.parameters()).device
    history = train(method, target, train_convs, eval_convs, opts, out / "head", dev, progress)
    plot(history, out, f"{method} head for {llm.model_path.name}")
    return out / "head"
