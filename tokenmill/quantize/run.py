"""The quantisation run: load the model in float32, calibrate and quantise its decoder layers
one after another, write the compressed-tensors folder.

Per layer: one pass over the calibration tokens with hooks on its four linears (fused
q/k/v, o, fused gate/up, down) collects what each method needs (GPTQ: the Hessian; AWQ and
the error report: per-channel magnitudes and a subset of tokens); the linears are quantised
(AWQ first searches and folds its scales: into the input norm for q/k/v, the post-attention
norm for gate/up, up's rows for down, v's rows for o when the heads are not grouped), their
float weights replaced by the dequantised ones, and a second pass gives the next layer its
inputs. A fused projection is quantised as one matrix (rows are independent under every
method) and written as its parts.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmill.errors import TokenmillError
from tokenmill.model.hf_export import check_exportable, write_model_files
from tokenmill.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from tokenmill.model.loader import load_checkpoint
from tokenmill.model.tokenizer import load_tokenizer
from tokenmill.quantize.calibrate.awq import MAX_TOKENS, ActivationStats, fake_quant, search_clip, search_scale
from tokenmill.quantize.calibrate.gptq import Hessian, gptq
from tokenmill.quantize.calibrate.rtn import QuantizedWeight, QuantSpec, relative_errors, rtn
from tokenmill.quantize.calibration import calibration_samples, calibration_texts
from tokenmill.quantize.compressed import (
    Scheme,
    linear_tensors,
    require_library,
    save_weights,
    write_quantization_config,
)
from tokenmill.quantize.layer_inputs import LayerInputs, linears_of

METHODS = ("rtn", "gptq", "awq")
# our fused linears -> the checkpoint's parts, in the order of their rows
PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


@dataclass(frozen=True)
class QuantizeOptions:
    method: str = "gptq"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True  # transformers 5.24 cannot load asymmetric pack-quantized folders
    samples: int = 128
    seq_len: int = 512
    calibration: str | None = None  # a text file; None: the default sources (quantize/calibration.py)
    dtype: torch.dtype = torch.bfloat16  # of the scales and the float tensors written
    clip: bool = True  # AWQ: search each group's clipping range
    act_order: bool = True  # GPTQ: columns by falling Hessian diagonal (llm-compressor's "static")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise TokenmillError(f"unknown method {self.method!r}; one of {', '.join(METHODS)}")
        if self.bits not in (4, 8):
            raise TokenmillError(f"--bits must be 4 or 8, got {self.bits}")
        if self.group_size < 1:
            raise TokenmillError(f"--group-size must be >= 1, got {self.group_size}")


@dataclass
class LinearReport:
    name: str  # ours: layers.{i}.self_attn.qkv_proj ...
    group_size: int
    error: float  # ||XW^T - XŴ^T|| / ||XW^T|| on the calibration inputs
    rtn_error: float  # the same for round to nearest of the same weight at the same bits and group


@dataclass
class QuantizeReport:
    folder: Path
    samples: int
    tokens: int
    seconds: float
    linears: list[LinearReport] = field(default_factory=list)
    weights: dict[str, QuantizedWeight] = field(default_factory=dict)  # what was written, by our (fused) names


def group_for(k: int, group_size: int) -> int:
    """The group size a linear with ``k`` inputs gets: ``group_size`` when it divides ``k``,
    else the largest power of two from 32 up to it that does (compressed-tensors and vLLM need
    whole groups, vLLM's GPU kernels 32, 64 or 128: SmolLM2's 576-wide layers take 64 for
    128), else one group per row."""
    if k % group_size == 0:
        return group_size
    g = 1 << (min(group_size, k).bit_length() - 1)
    while g >= 32:
        if k % g == 0:
            return g
        g //= 2
    return k


def quantize(
    model: str | Path | None, out: str | Path, opts: QuantizeOptions, log: Callable[[str], None] | None = None
) -> QuantizeReport:
    """Quantise ``model`` (anything tokenmill loads) into the folder ``out``."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    require_library()
    t0 = time.perf_counter()
    ckpt = load_checkpoint(model, torch.float32, progress=False)
    check_exportable(ckpt.config, ckpt.path, set(ckpt.weights))
    tokenizer = load_tokenizer(ckpt.path, ckpt.metadata)
    samples = calibration_samples(tokenizer, calibration_texts(opts.calibration), opts.samples, opts.seq_len)
    net = LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights)
    inputs = LayerInputs(net, samples)
    log(
        f"quantize: {opts.method} W{opts.bits}A16 group {opts.group_size} {'sym' if opts.symmetric else 'asym'}, "
        f"{len(samples)} samples x {len(samples[0])} tokens ({inputs.num_tokens} tokens), loaded in "
        f"{time.perf_counter() - t0:.1f}s"
    )
    report = QuantizeReport(Path(out), len(samples), inputs.num_tokens, 0.0)
    quantized = report.weights
    for i, layer in enumerate(net.layers):
        t = time.perf_counter()
        assert isinstance(layer, LlamaDecoderLayer)
        for name, (qw, rep) in _quantize_layer(net, i, inputs, opts).items():
            quantized[f"layers.{i}.{name}"] = qw
            report.linears.append(rep)
        inputs.run(i, advance=True)
        errs = report.linears[-4:]
        log(
            f"layer {i + 1}/{len(net.layers)}: error {sum(r.error for r in errs) / 4:.4f} "
            f"(rtn {sum(r.rtn_error for r in errs) / 4:.4f}), {time.perf_counter() - t:.1f}s, "
            f"elapsed {time.perf_counter() - t0:.1f}s"
        )
    _write(Path(out), ckpt.path, net, quantized, tokenizer, opts)
    report.seconds = time.perf_counter() - t0
    log(f"wrote {out} in {report.seconds:.1f}s")
    return report


def _quantize_layer(
    net: LlamaForCausalLM, index: int, inputs: LayerInputs, opts: QuantizeOptions
) -> dict[str, tuple[QuantizedWeight, LinearReport]]:
    layer = net.layers[index]
    linears = linears_of(layer)
    keep_every = max(1, -(-inputs.num_tokens // MAX_TOKENS))
    stats = {n: ActivationStats.empty(m.in_features) for n, m in linears.items()}
    hessians = {n: Hessian(m.in_features) for n, m in linears.items()} if opts.method == "gptq" else {}

    def seen(name: str, x: torch.Tensor) -> None:
        stats[name].add(x, keep_every)
        if name in hessians:
            hessians[name].add(x)

    inputs.run(index, seen)
    specs = {
        n: QuantSpec(opts.bits, group_for(m.in_features, opts.group_size), opts.symmetric) for n, m in linears.items()
    }
    originals = {n: m.weight.detach().float().clone() for n, m in linears.items()}
    in_scales = _awq_fold(net, index, stats, specs, opts) if opts.method == "awq" else {}
    out = {}
    for name, linear in linears.items():
        spec, w = specs[name], linear.weight.detach().float().clone()
        s = in_scales.get(name)
        x = stats[name].x()
        if opts.method == "gptq":
            qw = gptq(w, hessians[name].h, spec, opts.dtype, opts.act_order)
        elif opts.method == "awq":  # w is folded already: RTN within the clipping ranges found on x / s
            shrink = search_clip(w, x if s is None else x / s, spec, opts.dtype) if opts.clip else None
            qw = rtn(w, spec, opts.dtype, shrink)
        else:
            qw = rtn(w, spec, opts.dtype)
        w_hat = qw.dequantize()
        linear.weight.data.copy_(w_hat)
        baseline = fake_quant(originals[name], spec, opts.dtype)
        if s is None:  # the same inputs and weight: one reference for both
            error, rtn_error = relative_errors(x, w, [w_hat, baseline])
        else:  # AWQ: the folded weight on the scaled inputs, against RTN of the original
            error, rtn_error = relative_errors(x / s, w, [w_hat])[0], relative_errors(x, originals[name], [baseline])[0]
        out[name] = (qw, LinearReport(f"layers.{index}.{name}", spec.group_size, error, rtn_error))
    return out


def _awq_fold(
    net: LlamaForCausalLM,
    index: int,
    stats: dict[str, ActivationStats],
    specs: dict[str, QuantSpec],
    opts: QuantizeOptions,
) -> dict[str, torch.Tensor]:
    """Search every linear group's scale on the float weights, then fold them all (norm
    weights divided, the producing linear's rows divided, the consuming columns multiplied);
    returns each linear's input scale."""
    layer = net.layers[index]
    attn, mlp, cfg = layer.self_attn, layer.mlp, net.config
    lin = linears_of(layer)
    fold_o = cfg.num_heads == cfg.num_kv_heads and not cfg.attention_bias
    names = [n for n in lin if n != "self_attn.o_proj" or fold_o]
    scales = {
        n: search_scale([lin[n].weight.detach()], stats[n].x(), stats[n].mean_abs, specs[n], opts.dtype)[0]
        for n in names
    }
    with torch.no_grad():
        layer.input_layernorm.weight.div_(scales["self_attn.qkv_proj"])
        layer.post_attention_layernorm.weight.div_(scales["mlp.gate_up_proj"])
        mlp.gate_up_proj.weight[cfg.intermediate_size :].div_(scales["mlp.down_proj"][:, None])
        if fold_o:
            attn.qkv_proj.weight[attn.q_size + attn.kv_size :].div_(scales["self_attn.o_proj"][:, None])
        for n, s in scales.items():
            lin[n].weight.mul_(s)
    return scales


def _write(
    folder: Path, source: Path, net: LlamaForCausalLM, quantized: dict[str, QuantizedWeight], tokenizer, opts
) -> None:
    """The folder: model files, the quantised linears split into the checkpoint's parts,
    every other weight (embedding, norms, LM head, q/k/v biases) in ``opts.dtype``."""
    write_model_files(folder, source, net.config, tokenizer, opts.dtype)
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[int, list[str]] = {}  # group size -> the parts' names that took it
    for name, qw in quantized.items():
        layer, fused = name.split(".", 2)[:2], name.split(".", 2)[2]
        rows = _rows(net, fused)
        zeros = qw.zero.split(rows) if qw.zero is not None else [None] * len(rows)
        for part, q, s, z in zip(PARTS[fused], qw.q.split(rows), qw.scale.split(rows), zeros, strict=True):
            tensors |= linear_tensors(f"model.{'.'.join(layer)}.{part}", QuantizedWeight(q, s, z, qw.spec))
            parts = groups.setdefault(qw.spec.group_size, [])
            if part.rsplit(".", 1)[-1] not in parts:
                parts.append(part.rsplit(".", 1)[-1])
    for name, t in net.state_dict().items():
        module, _, kind = name.rpartition(".")
        if kind not in ("weight", "bias"):
            continue
        fused = module.split(".", 2)[-1] if module.startswith("layers.") else ""
        if fused not in PARTS:
            tensors[name if name.startswith("lm_head.") else f"model.{name}"] = t.to(opts.dtype)
        elif kind == "bias":  # q/k/v biases stay float, split as the rows are
            layer = module.rsplit(".", 2)[0]
            for part, b in zip(PARTS[fused], t.split(_rows(net, fused)), strict=True):
                tensors[f"model.{layer}.{part}.bias"] = b.to(opts.dtype)
    save_weights(folder, tensors)
    write_quantization_config(folder, _schemes(groups, opts), ["lm_head"])


def _rows(net: LlamaForCausalLM, fused: str) -> list[int]:
    """Rows of each checkpoint part of one of our fused linears."""
    cfg = net.config
    if fused == "self_attn.qkv_proj":
        kv = cfg.num_kv_heads * cfg.head_dim
        return [cfg.num_heads * cfg.head_dim, kv, kv]
    if fused == "mlp.gate_up_proj":
        return [cfg.intermediate_size, cfg.intermediate_size]
    return [cfg.hidden_size]  # o_proj, down_proj


def _schemes(groups: dict[int, list[str]], opts: QuantizeOptions) -> list[Scheme]:
    """One config group targeting every Linear, or (some widths took another group size)
    one per group size, targeting its linears by name."""
    if len(groups) == 1:
        return [Scheme(("Linear",), opts.bits, next(iter(groups)), opts.symmetric)]
    return [
        Scheme((f"re:.*\\.({'|'.join(parts)})$",), opts.bits, g, opts.symmetric) for g, parts in sorted(groups.items())
    ]
