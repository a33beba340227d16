"""Our decoder run over calibration samples one layer at a time, without the engine.

The samples form flat batches of at most ``CHUNK_TOKENS`` tokens (their positions, attention
metadata and one paged KV cache, reused by every layer since layers run one after another).
The residual stream entering the current layer is kept per batch; a layer is run on it with
forward hooks on its linears (what each linear sees is handed to a callback: GPTQ's Hessian,
AWQ's statistics), then, once quantised, run again to give the next layer its input: the
layer-by-layer order of GPTQ and llm-compressor, where layer i + 1 is calibrated on what the
already quantised layer i produces. The input norm is applied here, with the layer's current
weight (AWQ may have folded scales into it since the last layer ran).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.model.layers.attention import AttentionMetadata
from tokenmill.model.layers.kv_cache import KVCacheLayer
from tokenmill.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.inputs import SeqInput, prepare_inputs

CHUNK_TOKENS = 4096  # tokens per forward: bounds the MLP's activations ([T, 2 * intermediate])
BLOCK_SIZE = 16


@dataclass
class _Batch:
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    x: torch.Tensor  # [T, hidden]: the residual stream entering the current layer


def linears_of(layer: LlamaDecoderLayer) -> dict[str, nn.Linear]:
    """The layer's linears by our (fused) names."""
    attn, mlp = layer.self_attn, layer.mlp
    return {
        "self_attn.qkv_proj": attn.qkv_proj,
        "self_attn.o_proj": attn.o_proj,
        "mlp.gate_up_proj": mlp.gate_up_proj,
        "mlp.down_proj": mlp.down_proj,
    }


class LayerInputs:
    """The calibration samples' residual streams, advanced one decoder layer at a time."""

    def __init__(self, model: LlamaForCausalLM, samples: list[list[int]]) -> None:
        assert model.rotary is not None and model.embed_tokens is not None
        self.model = model
        cfg = model.config
        chunks = self._chunks(samples)
        self.batches = [self._batch(c) for c in chunks]
        blocks = max(sum(-(-len(s) // BLOCK_SIZE) for s in c) for c in chunks)
        shape = (blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        self.cache = KVCacheLayer(torch.zeros(shape), torch.zeros(shape), torch.float32)
        self.num_tokens = sum(map(len, samples))

    @staticmethod
    def _chunks(samples: list[list[int]]) -> list[list[list[int]]]:
        out: list[list[list[int]]] = [[]]
        for s in samples:
            if out[-1] and sum(map(len, out[-1])) + len(s) > CHUNK_TOKENS:
                out.append([])
            out[-1].append(s)
        return out

    def _batch(self, chunk: list[list[int]]) -> _Batch:
        seqs, next_block = [], 0
        for i, ids in enumerate(chunk):
            n = -(-len(ids) // BLOCK_SIZE)
            table = list(range(next_block, next_block + n))
            next_block += n
            seqs.append(SeqInput(str(i), list(ids), 0, table, False, SamplingParams(), [], []))
        input_ids, positions, meta, _ = prepare_inputs(seqs, BLOCK_SIZE, torch.device("cpu"))
        with torch.inference_mode():
            x = self.model._embed(input_ids).float()
        return _Batch(positions, meta, x)

    @torch.inference_mode()
    def run(self, index: int, seen: Callable[[str, torch.Tensor], None] | None = None, advance: bool = False) -> None:
        """Run layer ``index`` over every batch; ``seen(name, x)`` gets each linear's inputs
        ([T, K]); ``advance``: the layer's outputs become the batches' residual streams."""
        model = self.model
        layer = model.layers[index]
        assert isinstance(layer, LlamaDecoderLayer)
        hooks = []
        if seen is not None:
            for name, linear in linears_of(layer).items():
                hooks.append(linear.register_forward_hook(lambda _m, args, _o, name=name: seen(name, args[0])))
        rotary = model.rotary_local if model.rotary_local is not None and layer.self_attn.window else model.rotary
        norm = layer.input_layernorm
        try:
            for b in self.batches:
                h = model.ops.rms_norm(b.x, norm.weight, norm.eps)
                out = layer(h, b.x.clone(), b.positions, rotary, self.cache, b.meta, model.ops, None)
                if advance:
                    b.x = out
        finally:
            for hook in hooks:
                hook.remove()
