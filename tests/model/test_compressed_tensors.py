"""compressed-tensors folders (llm-compressor's format) and FP8 checkpoints: tiny random Llama and
Qwen3 models quantised and saved by the compressed-tensors library itself (its QuantizationConfig,
its qparams, its ModelCompressor). Decoded by our loader, their weights are the library's own
decompression to the bit; served from the native kernels' blocks, their greedy tokens are
transformers' on the same folder; what we cannot decode is refused by name."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import write_qwen3_tokenizer
from tokenmill.errors import ModelLoadError
from tokenmill.kernels.native import load_native
from tokenmill.model.loader import load_checkpoint
from tokenmill.quant.packed import PackedWeight, QuantLinear

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

INT8_TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
FP8_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
# name: (format, weights' QuantizationArgs, input activations' or None)
SCHEMES = {
    "w4a16-asym-g32": (
        "pack-quantized",
        {"num_bits": 4, "symmetric": False, "strategy": "group", "group_size": 32},
        None,
    ),
    "w4a16-sym-g64": (
        "pack-quantized",
        {"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 64},
        None,
    ),
    "w4a16-channel": ("pack-quantized", {"num_bits": 4, "symmetric": True, "strategy": "channel"}, None),
    "w8a16-channel": ("pack-quantized", {"num_bits": 8, "symmetric": True, "strategy": "channel"}, None),
    "w8a16-asym-g32": (
        "pack-quantized",
        {"num_bits": 8, "symmetric": False, "strategy": "group", "group_size": 32},
        None,
    ),
    "w8a8-int": ("int-quantized", {"num_bits": 8, "symmetric": True, "strategy": "channel"}, INT8_TOKEN),
    "fp8-channel": ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"}, FP8_TOKEN),
    "fp8-tensor": ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "tensor"}, FP8_TOKEN),
}
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


def _qparams(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest scale and zero point from the min and max of each group (the library's
    calculate_qparams; what llm-compressor's min-max observer feeds it)."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    n, k = weight.shape
    size = {"group": args.group_size, "channel": k, "tensor": n * k}[args.strategy]
    g = weight.reshape(-1, size) if args.strategy == "tensor" else weight.reshape(n, k // size, size)
    return calculate_qparams(g.amin(-1), g.amax(-1), args)


def write_ct_folder(src, dst, scheme: str, scale_dtype=torch.bfloat16) -> None:
    """``src``'s float folder quantised by the compressed-tensors library into ``dst``, its
    scales in ``scale_dtype`` (llm-compressor keeps them in the model's: bfloat16, mostly)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    fmt, weights, acts = SCHEMES[scheme]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = QuantizationArgs(**weights)
    group = QuantizationScheme(
        targets=["Linear"], weights=args, input_activations=QuantizationArgs(**acts) if acts else None
    )
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": group}, ignore=["lm_head"]))
    for _, module in model.named_modules():
        if hasattr(module, "weight_scale"):
            scale, zero = _qparams(module.weight.data, args)
            module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(scale_dtype)
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)


def library_weights(folder, scheme: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The linear weights as the compressed-tensors library's own compressor for the folder's
    format decompresses its saved tensors, computed in ``dtype`` (our names). (Not through
    transformers: 5.24 cannot load asymmetric pack-quantized folders, its zero points' shape
    mismatches the packed one.)"""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    fmt, weights, acts = SCHEMES[scheme]
    group = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**weights),
        input_activations=QuantizationArgs(**acts) if acts else None,
    )
    compressor = BaseCompressor.get_value_from_registry(fmt)
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in load_file(str(folder / "model.safetensors")).items():
        layer, _, part = name.rpartition(".")
        if "_proj" in layer:
            layers.setdefault(layer, {})[part] = t.to(dtype) if part == "weight_scale" else t
    return {
        f"{layer.removeprefix('model.')}.weight": compressor.decompress(parts, group)["weight"]
        for layer, parts in layers.items()
    }


def make_float_folder(folder, family: str):
    config_cls, model_cls, extra = FAMILIES[family]
    tokenizer = write_qwen3_tokenizer(folder)
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **extra,
    )
    getattr(transformers, model_cls)(config).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return make_float_folder(tmp_path_factory.mktemp("llama"), "llama")


def _decoded_layers(folder) -> dict[str, object]:
    """Each quantised layer's decoding by our loader's quantisation object (our names)."""
    from safetensors.torch import load_file

    from tokenmill.quant.hf_quant import hf_quantization

    quant = hf_quantization(json.loads((folder / "config.json").read_text()), folder)
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in load_file(str(folder / "model.safetensors")).items():
        layer, _, part = name.rpartition(".")
        if quant.takes(part, t):
            layers.setdefault(layer, {})[part] = t
    return {f"{k.removeprefix('model.')}.weight": quant.decode(parts, k) for k, parts in layers.items()}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_decode_holds_the_librarys_numbers(tmp_path, llama_folder, scheme):
    """Our decoding holds the very integers, zero points and scales the library wrote (bfloat16
    scales): ``q * scale + min`` in float64 is the library's ``(q - zero) * scale``, and in
    float32 both are exact, so the dequantised weights equal the library's to the bit and the
    kernels' blocks hold them. FP8: the weights the library decompresses in its bfloat16, kept
    in bfloat16 for the 16-bit kernels."""
    dst = tmp_path / scheme
    write_ct_folder(llama_folder, dst, scheme)
    plain = load_checkpoint(dst, torch.float32, progress=False).weights
    kept = load_checkpoint(dst, torch.float32, progress=False, keep_quantized=True).weights
    if scheme.startswith("fp8"):
        want = library_weights(dst, scheme, torch.bfloat16)
        assert len(want) == 2 * 7
        for name, w in want.items():
            assert torch.equal(plain[name], w.float()), name
            assert kept[name].dtype == torch.bfloat16 and torch.equal(kept[name], w), name
        return
    exact = library_weights(dst, scheme, torch.float64)
    want = library_weights(dst, scheme, torch.float32)
    assert len(want) == 2 * 7
    for name, g in _decoded_layers(dst).items():
        w = g.q.double().reshape(*g.scale.shape, -1) * g.scale.double()[..., None]
        if g.minv is not None:
            w = w + g.minv.double()[..., None]
        assert torch.equal(w.reshape(g.q.shape), exact[name]), name
    for name, w in want.items():
        assert torch.equal(plain[name], w), name
        k = kept[name]
        assert isinstance(k, PackedWeight) and k.bits == SCHEMES[scheme][1]["num_bits"], name
        assert torch.equal(k.dequantize(), w), name


def test_float32_scales_are_within_a_rounding(tmp_path, llama_folder):
    """float32 scales (a float32 model quantised): ``q * scale + min`` rounds where
    ``(q - zero) * scale`` is exact in the integers, so the weights agree within a rounding of
    the largest, not to the bit."""
    dst = tmp_path / "f32"
    write_ct_folder(llama_folder, dst, "w4a16-asym-g32", scale_dtype=torch.float32)
    plain = load_checkpoint(dst, torch.float32, progress=False).weights
    for name, w in library_weights(dst, "w4a16-asym-g32", torch.float64).items():
        assert (plain[name].double() - w).abs().max() <= w.abs().max() * 2**-23, name


@pytest.mark.parametrize(
    ("family", "scheme"),
    [("llama", "w4a16-sym-g64"), ("qwen3", "w4a16-channel"), ("llama", "w8a16-channel"), ("qwen3", "w8a8-int")],
)
def test_greedy_tokens_equal_transformers(tmp_path, family, scheme, caplog):
    """Served the default way (int weights in the native kernels' blocks), a folder the library
    wrote answers with transformers' greedy tokens on the same folder (symmetric schemes:
    transformers 5.24 cannot load asymmetric ones); W8A8's activation quantisation is named in
    the log, not silently dropped."""
    from tokenmill import LLM, SamplingParams

    src = make_float_folder(tmp_path / "float", family)
    dst = tmp_path / scheme
    write_ct_folder(src, dst, scheme)
    prompts = ["Hello there, how are you today? I am", "1, 2, 3, 4,"]
    tok = transformers.AutoTokenizer.from_pretrained(dst)
    model = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    want = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        want.append(out[0, ids.shape[1] :].tolist())
    with caplog.at_level(logging.WARNING, logger="tokenmill.model.loader"):
        llm = LLM(str(dst), dtype="float32", progress=False, kv_cache_memory="16MiB", enable_prefix_caching=False)
    assert ("dynamic int8 activations" in caplog.text) == (scheme == "w8a8-int")
    if load_native():
        assert isinstance(llm.parts.model.layers[0].mlp.down_proj, QuantLinear)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want


def test_fp8_checkpoint_with_block_scales(tmp_path, llama_folder):
    """``quant_method: fp8`` (DeepSeek / Qwen FP8: e4m3 weights, a ``weight_scale_inv`` per block of
    128 x 128, here 32 x 32) decodes to weight x its block's scale, and answers like the float
    model holding those very weights."""
    from safetensors.torch import load_file

    from tokenmill import LLM, SamplingParams

    dst = tmp_path / "fp8-block"
    dst.mkdir()
    tensors, want = {}, {}
    for name, t in load_file(str(llama_folder / "model.safetensors")).items():
        if not name.endswith("_proj.weight"):
            tensors[name] = t
            continue
        n, k = t.shape
        blocks = t.reshape(n // 32, 32, k // 32, 32)
        scale = blocks.abs().amax((1, 3)) / 448
        q = (blocks / scale[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
        tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = q, scale
        full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
        want[name.removeprefix("model.")] = q.float() * full
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((llama_folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
    }
    (dst / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_folder / f, dst / f)
    weights = load_checkpoint(dst, torch.float32, progress=False).weights
    for name, w in want.items():
        assert torch.equal(weights[name], w), name
    # the same weights as a plain float folder: the reference
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    plain = {k: v for k, v in load_file(str(llama_folder / "model.safetensors")).items()}
    plain.update({f"model.{k}": v for k, v in want.items()})
    save_file(plain, str(ref_dir / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_folder / f, ref_dir / f)
    common = dict(dtype="float32", progress=False, kv_cache_memory="16MiB", enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["Hello there, how are you today? I am"]
    got = LLM(str(dst), **common).generate(prompts, params)[0].outputs[0].token_ids
    assert got == LLM(str(ref_dir), **common).generate(prompts, params)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme is not supported"),
        ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config is not supported"),
        ({"transform_config": {"config_groups": {"u": {}}}}, "transform_config is not supported"),
        ({"quantization_status": "frozen"}, "quantization_status 'frozen' is not supported"),
        ({"format": "marlin-24"}, "format 'marlin-24'"),
        ({"bits": 3}, "int weights of 3 bits in format 'pack-quantized'"),
        ({"strategy": "block"}, "int weights in strategy 'block'"),
    ],
    ids=["kv-cache-scheme", "sparsity", "transform", "frozen", "marlin-24", "3-bit", "int-block"],
)
def test_what_we_cannot_decode_is_refused_by_name(tmp_path, llama_folder, change, named):
    dst = tmp_path / "w4"
    write_ct_folder(llama_folder, dst, "w4a16-asym-g32")
    config = json.loads((dst / "config.json").read_text())
    qc = config["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    if "bits" in change:
        weights["num_bits"] = change["bits"]
    elif "strategy" in change:
        weights["strategy"], weights["block_structure"] = "block", [32, 32]
    elif "format" in change:
        qc["format"] = change["format"]
        qc["config_groups"]["group_0"].pop("format", None)
    else:
        qc.update(change)
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="not supported") as e:
        load_checkpoint(dst, progress=False)
    assert named in str(e.value)


def test_lora_on_top_of_the_quantised_weights(tmp_path, llama_folder):
    """A LoRA adapter applies on top of a compressed-tensors W4A16 model served from the
    kernels' blocks: its greedy tokens are the dequantised folder's with the same adapter,
    and differ from the model's without it."""
    from tests.helpers import write_adapter
    from tokenmill import LLM, SamplingParams

    dst = tmp_path / "w4"
    write_ct_folder(llama_folder, dst, "w4a16-asym-g32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_folder, dtype=torch.float32)
    adapter = write_adapter(tmp_path / "adapter", hf, rank=4, alpha=8, seed=1)
    common = dict(
        dtype="float32",
        progress=False,
        kv_cache_memory="16MiB",
        enable_lora=True,
        lora_modules=[f"a={adapter}"],
        max_lora_rank=8,
    )
    native = LLM(str(dst), **common)
    ref = LLM(str(dst), quantization="none", **common)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["Hello there, how are you today? I am", "1, 2, 3, 4,"]
    with_adapter = [o.outputs[0].token_ids for o in native.generate(prompts, params, lora=["a", "a"])]
    assert with_adapter == [o.outputs[0].token_ids for o in ref.generate(prompts, params, lora=["a", "a"])]
    assert with_adapter != [o.outputs[0].token_ids for o in native.generate(prompts, params)]
