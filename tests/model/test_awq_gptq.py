"""AWQ (GEMM) and GPTQ (v1) folders: tiny random Llamas quantised here (per-group asymmetric
int4, round to nearest) and packed exactly as AutoAWQ and AutoGPTQ lay their tensors out. The
loader decodes them to the very numbers packed (dequantised, and as the kernels' int4 blocks),
the model served from the blocks gives the dequantised model's greedy tokens, and quantisations
we do not decode are refused by name."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import make_tiny_llama, write_qwen3_tokenizer
from tokenmill.errors import ModelLoadError
from tokenmill.kernels.native import load_native
from tokenmill.model.loader import load_checkpoint
from tokenmill.quant.hf_quant import AWQ_ORDER
from tokenmill.quant.packed import PackedWeight, QuantLinear

transformers = pytest.importorskip("transformers")

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name: (quant_method, group size, GPTQ sym, GPTQ act order, bits)
FORMATS = {
    "awq-g64": ("awq", 64, False, False, 4),
    "awq-g32": ("awq", 32, False, False, 4),
    "gptq-asym-g32": ("gptq", 32, False, False, 4),
    "gptq-sym-g64": ("gptq", 64, True, False, 4),
    "gptq-act-order-g32": ("gptq", 32, False, True, 4),
    "gptq-8bit-asym-g32": ("gptq", 32, False, False, 8),
    "gptq-8bit-sym-g64": ("gptq", 64, True, False, 8),
}


def quantize(w: torch.Tensor, group: int, sym: bool, perm: torch.Tensor | None, bits: int = 4):
    """w [N, K] -> q [K, N] (0..2^bits-1), zeros [K/G, N] (from 1: GPTQ v1 stores zero - 1, so 0
    has no encoding), scales [K/G, N] float16, g_idx [K]; groups run along K in ``perm``'s order
    (act order) or in K's."""
    n, k = w.shape
    maxq = (1 << bits) - 1
    perm = torch.arange(k) if perm is None else perm
    g = w.float().T[perm].reshape(k // group, group, n)
    lo, hi = g.amin(1), g.amax(1)
    if sym:
        scales = (torch.maximum(-lo, hi) / (maxq / 2)).clamp(min=1e-4).half()
        zeros = torch.full_like(scales, (maxq + 1) // 2, dtype=torch.int32)
    else:
        scales = ((hi - lo) / maxq).clamp(min=1e-4).half()
        zeros = (-lo / scales.float()).round().clamp(1, maxq).to(torch.int32)
    qp = (g / scales.float()[:, None]).round().to(torch.int32) + zeros[:, None]
    q = torch.empty(k, n, dtype=torch.int32)
    q[perm] = qp.clamp(0, maxq).reshape(k, n)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
    return q, zeros, scales, g_idx


def dequantized(q, zeros, scales, g_idx) -> torch.Tensor:
    """The float32 [N, K] weight the parts stand for: (q - zero) * scale."""
    return ((q - zeros[g_idx.long()]).float() * scales[g_idx.long()].float()).T.contiguous()


def words(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[..., 32 / bits] values -> [...] int32: value i in bits (bits i)..(bits (i + 1) - 1)."""
    acc = torch.zeros(values.shape[:-1], dtype=torch.int64)
    for i in range(32 // bits):
        acc |= values[..., i].long() << (bits * i)
    return (acc - ((acc >> 31) << 32)).to(torch.int32)  # two's complement of the top bit


def pack_awq(v: torch.Tensor) -> torch.Tensor:
    """[R, N] -> [R, N/8]: word c's nibble i holds column 8c + AWQ_ORDER[i] (AutoAWQ's pack)."""
    return words(v.reshape(v.shape[0], -1, 8)[..., list(AWQ_ORDER)])


def pack_gptq_rows(q: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[K, N] -> [K/8, N] (4 bits; [K/4, N] 8 bits): word r's value i holds row 8r + i (4r + i)."""
    per = 32 // bits
    return words(q.reshape(-1, per, q.shape[1]).transpose(1, 2), bits)


def pack_gptq_cols(v: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[R, N] -> [R, N/8] (4 bits; [R, N/4] 8 bits): word c's value i holds column 8c + i (4c + i)."""
    return words(v.reshape(v.shape[0], -1, 32 // bits), bits)


def write_quantized(src, dst, fmt: str) -> dict[str, torch.Tensor]:
    """``src``'s float Llama folder quantised into ``dst`` in format ``fmt``; returns the float32
    weights (our names) the packed parts stand for."""
    method, group, sym, act_order, bits = FORMATS[fmt]
    tensors = load_file(str(src / "model.safetensors"))
    out, expected = {}, {}
    gen = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        layer = name.removesuffix(".weight")
        if not (name.endswith(".weight") and layer.rsplit(".", 1)[-1] in LINEARS):
            out[name] = t
            continue
        perm = torch.randperm(t.shape[1], generator=gen) if act_order else None
        q, zeros, scales, g_idx = quantize(t, group, sym, perm, bits)
        expected[layer.removeprefix("model.") + ".weight"] = dequantized(q, zeros, scales, g_idx)
        out[f"{layer}.scales"] = scales
        if method == "awq":
            out[f"{layer}.qweight"], out[f"{layer}.qzeros"] = pack_awq(q), pack_awq(zeros)
        else:
            out[f"{layer}.qweight"] = pack_gptq_rows(q, bits)
            out[f"{layer}.qzeros"] = pack_gptq_cols(zeros - 1, bits)
            out[f"{layer}.g_idx"] = g_idx
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    else:
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order}
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    return expected


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("float")
    tokenizer = write_qwen3_tokenizer(folder)
    make_tiny_llama(
        folder,
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return folder


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_is_bit_exact(tmp_path, float_folder, fmt):
    """Dequantised, and as the kernels' blocks (where kept), the loader's weights are the
    packed numbers to the bit."""
    expected = write_quantized(float_folder, tmp_path / fmt, fmt)
    plain = load_checkpoint(tmp_path / fmt, torch.float32, progress=False).weights
    kept = load_checkpoint(tmp_path / fmt, torch.float32, progress=False, keep_quantized=True).weights
    assert len(expected) == 2 * len(LINEARS)
    for name, want in expected.items():
        assert torch.equal(plain[name], want), name
        if FORMATS[fmt][3]:  # act order: no groups of 32 to keep, dequantised
            assert torch.equal(kept[name], want), name
            continue
        assert isinstance(kept[name], PackedWeight), name
        assert torch.equal(kept[name].dequantize(), want), name
        if load_native():
            assert torch.equal(kept[name].dequantize_rows(), want), name


@pytest.mark.skipif(not load_native(), reason="native kernels did not build")
@pytest.mark.parametrize(
    "fmt", ["awq-g64", "gptq-asym-g32", "gptq-sym-g64", "gptq-act-order-g32", "gptq-8bit-asym-g32"]
)
def test_served_from_blocks_matches_dequantized_model(tmp_path, float_folder, fmt, caplog):
    """``quantization auto`` on the CPU serves the int4 blocks (q/k/v and gate/up fused); its
    greedy tokens are those of the same folder dequantised (``quantization none``)."""
    from tokenmill import LLM, SamplingParams

    write_quantized(float_folder, tmp_path / fmt, fmt)
    common = dict(dtype="float32", progress=False, kv_cache_memory="16MiB", enable_prefix_caching=False)
    with caplog.at_level(logging.INFO, logger="tokenmill.model.loader"):
        native = LLM(str(tmp_path / fmt), **common)
    ref = LLM(str(tmp_path / fmt), quantization="none", **common)
    layer = native.parts.model.layers[1]
    act_order = FORMATS[fmt][3]
    for linear in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear, QuantLinear) != act_order
    assert ("act order" in caplog.text) == act_order
    assert not isinstance(ref.parts.model.layers[1].mlp.down_proj, QuantLinear)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    prompts = ["Hello there, how are you today? I am", "1, 2, 3, 4,"]
    for x, y in zip(native.generate(prompts, params), ref.generate(prompts, params), strict=True):
        assert x.token_ids == y.token_ids
        assert max(abs(a - b) for a, b in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True)) < 3e-4


@pytest.mark.parametrize(
    ("qc", "named"),
    [
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float"}}},
            },
            "format 'nvfp4-pack-quantized'",
        ),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, "AWQ version 'exllama'"),
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, "awq with 8 bits"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with 3 bits"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"}, "checkpoint_format 'gptq_v2'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not supported"),
    ],
    ids=["compressed-tensors-nvfp4", "fp8-e5m2", "awq-gemv", "awq-exllama", "awq-8bit", "gptq-3bit", "gptq-v2", "bnb"],
)
def test_unsupported_quantization_is_refused(tmp_path, qc, named):
    make_tiny_llama(tmp_path, num_hidden_layers=1)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(ModelLoadError, match="not supported") as e:
        load_checkpoint(tmp_path, progress=False)
    assert named in str(e.value)
