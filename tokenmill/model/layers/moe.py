"""Mixture-of-experts MLP (Mixtral): a router picks ``top_k`` of ``num_experts`` SwiGLU
experts per token, and their outputs are summed with the router's renormalised weights.

Experts are batched by assignment: the (token, expert) pairs are sorted by expert, so
each expert that has tokens this step runs one GEMM pair over all of its rows, and
experts nobody chose cost nothing. The experts' weights are stacked
(``w13``: [experts, 2 x intermediate, hidden], gate rows then up rows; ``w2``:
[experts, hidden, intermediate]), which is also how tensor parallelism cuts them: each
rank holds every expert's slice of the intermediate columns, exactly as for a dense MLP,
so one all-reduce after the layer still adds the partial sums. (Expert parallelism,
whole experts per rank, would cut the first axis instead.)
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.configuration.config import ModelConfig


class MoEMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.w13 = nn.Parameter(torch.empty(cfg.num_experts, 2 * cfg.intermediate_size, cfg.hidden_size))
        self.w2 = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [n, top_k] and weights [n, top_k] (float32, summing to 1)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        return experts, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor, ops, tp=None) -> torch.Tensor:
        experts, weights = self.route(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // self.top_k  # the token of each sorted pair
        pair_weights = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            idx = rows[start : start + count]
            h = ops.silu_mul(nn.functional.linear(x[idx], self.w13[e]))
            y = nn.functional.linear(h, self.w2[e]) * pair_weights[start : start + count, None]
            out.index_add_(0, idx, y.to(out.dtype))
            start += count
        return out if tp is None else tp.all_reduce(out)


def stack_experts(weights: dict[str, torch.Tensor], num_layers: int, num_experts: int) -> dict[str, torch.Tensor]:
    """Mixtral's checkpoint names -> our stacked experts: per layer ``block_sparse_moe.gate``
    and ``experts.{j}.w1/w3/w2`` (gate, up, down) from a hub folder, or transformers'
    in-memory ``mlp.experts.gate_up_proj/down_proj``, or a GGUF's ``*_exps`` (already
    renamed by the loader to mlp.w1/w3/w2 stacks)."""
    weights = dict(weights)
    for i in range(num_layers):
        try:
            _stack_layer(weights, f"layers.{i}.", num_experts)
        except RuntimeError as e:  # experts of different shapes
            raise ValueError(f"checkpoint does not fit the model: the experts of layers.{i}: {e}") from None
    return weights


def _stack_layer(weights: dict[str, torch.Tensor], p: str, num_experts: int) -> None:
    """One layer's experts, stacked in place."""
    if f"{p}block_sparse_moe.gate.weight" in weights:
        weights[f"{p}mlp.gate.weight"] = weights.pop(f"{p}block_sparse_moe.gate.weight")
        parts = {
            w: [weights.pop(f"{p}block_sparse_moe.experts.{j}.{w}.weight") for j in range(num_experts)]
            for w in ("w1", "w3", "w2")
        }
        weights[f"{p}mlp.w13"] = torch.stack([torch.cat([g, u]) for g, u in zip(parts["w1"], parts["w3"], strict=True)])
        weights[f"{p}mlp.w2"] = torch.stack(parts["w2"])
    elif f"{p}mlp.experts.gate_up_proj" in weights:
        weights[f"{p}mlp.w13"] = weights.pop(f"{p}mlp.experts.gate_up_proj")
        weights[f"{p}mlp.w2"] = weights.pop(f"{p}mlp.experts.down_proj")
    elif f"{p}mlp.w1_exps.weight" in weights:  # GGUF: gate and up stacked separately
        gate, up = weights.pop(f"{p}mlp.w1_exps.weight"), weights.pop(f"{p}mlp.w3_exps.weight")
        weights[f"{p}mlp.w13"] = torch.cat([gate, up], dim=1)
        weights[f"{p}mlp.w2"] = weights.pop(f"{p}mlp.w2_exps.weight")
    else:
        raise ValueError(f"checkpoint does not fit the model: {p[:-1]} has no experts")
