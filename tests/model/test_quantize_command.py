"""`tokenmill quantize`: tiny random Llamas quantised by RTN, GPTQ and AWQ into compressed-tensors
``pack-quantized`` folders. The folder holds, to the bit, the integers and scales the run
chose (read back through the compressed-tensors library and through transformers); GPTQ and
AWQ reconstruct the calibration outputs better than round to nearest; tokenmill and
transformers answer alike on the folder; the real default model quantises from its GGUF and
answers a chat prompt (slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import gguf_tokenizer_metadata, make_tiny_llama, write_gguf, write_qwen3_tokenizer
from tokenmill.model.paths import default_model_path
from tokenmill.quantize.run import PARTS, QuantizeOptions, group_for, quantize

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

SAMPLES, SEQ_LEN = 8, 64


def tiny_folder(folder, outliers: float | None = None):
    """A 2-layer random Llama with SmolLM2's vocabulary; ``outliers``: the first 4 channels of
    every norm's weight multiplied by it (the inputs of q/k/v and gate/up get a few large
    channels, as trained models have)."""
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
    if outliers is not None:
        weights = load_file(str(folder / "model.safetensors"))
        for name, t in weights.items():
            if name.endswith("layernorm.weight"):
                t[:4] *= outliers
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("float"))


@pytest.fixture(scope="module")
def written(float_folder, tmp_path_factory):
    """Each method's folder (group 32, symmetric, float32 scales) and its report."""
    out = {}
    for method in ("rtn", "gptq", "awq"):
        folder = tmp_path_factory.mktemp(method)
        opts = QuantizeOptions(method, 4, 32, True, SAMPLES, SEQ_LEN, dtype=torch.float32)
        out[method] = (folder, quantize(float_folder, folder, opts, log=lambda _: None))
    return out


def parts_of(report) -> dict[str, tuple]:
    """Our fused QuantizedWeights split into the checkpoint's linears: name -> (q, scale, zero)."""
    from tokenmill.quantize.calibrate.rtn import QuantizedWeight

    out = {}
    for name, qw in report.weights.items():
        layer, fused = name.rsplit(".", 2)[0], ".".join(name.rsplit(".", 2)[1:])
        n = len(PARTS[fused])
        rows = qw.q.shape[0] // n if fused != "self_attn.qkv_proj" else None
        sizes = [rows] * n if rows else [64, 16, 16]  # q: 8 heads x 8, k and v: 2 heads x 8
        zeros = qw.zero.split(sizes) if qw.zero is not None else [None] * n
        for part, q, s, z in zip(PARTS[fused], qw.q.split(sizes), qw.scale.split(sizes), zeros, strict=True):
            out[f"model.{layer}.{part}"] = QuantizedWeight(q, s, z, qw.spec)
    return out


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_folder_holds_the_chosen_integers_and_transformers_decompresses_them(written, method):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    folder, report = written[method]
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["quant_method"] == "compressed-tensors"
    group = config["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and config["ignore"] == ["lm_head"]
    assert group["weights"] | {"num_bits": 4, "group_size": 32, "symmetric": True} == group["weights"]
    tensors = load_file(str(folder / "model.safetensors"))
    ours = parts_of(report)
    assert len(ours) == 14
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model(torch.tensor([[1, 2, 3]]))  # the first forward decompresses the linears
    for name, qw in ours.items():
        shape = tensors[f"{name}.weight_shape"].tolist()
        assert shape == list(qw.q.shape), name
        assert torch.equal(unpack_from_int32(tensors[f"{name}.weight_packed"], 4, torch.Size(shape)), qw.q), name
        assert torch.equal(tensors[f"{name}.weight_scale"], qw.scale), name
        assert f"{name}.weight_zero_point" not in tensors, name
        assert torch.equal(model.get_submodule(name).weight, qw.dequantize()), name


def test_asymmetric_8_bit_zero_points_round_trip_through_the_library(float_folder, tmp_path):
    """Zero points packed along N as the library unpacks them (through its compressor:
    transformers 5.24 cannot load asymmetric pack-quantized folders); bfloat16 scales."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    opts = QuantizeOptions("gptq", 8, 32, False, SAMPLES, SEQ_LEN, dtype=torch.bfloat16)
    report = quantize(float_folder, tmp_path, opts, log=lambda _: None)
    weights = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights["weights"]))
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name, qw in parts_of(report).items():
        assert qw.zero is not None and tensors[f"{name}.weight_scale"].dtype == torch.bfloat16
        parts = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == name}
        got = compressor.decompress(parts, scheme)
        assert torch.equal(got["weight_zero_point"], qw.zero), name
        assert torch.equal(got["weight"], qw.dequantize().to(torch.bfloat16)), name


def test_gptq_reconstructs_the_calibration_outputs_better_than_rtn(written):
    """On every linear's calibration inputs, ||XW^T - XŴ^T|| is lower for GPTQ than for round
    to nearest at the same bits and groups; the RTN baseline it is held to is the RTN run's
    own error where both see the same inputs (layer 0)."""
    gptq, rtn = written["gptq"][1], written["rtn"][1]
    for r in gptq.linears:
        assert r.error < r.rtn_error, r
    for g, r in zip(gptq.linears[:4], rtn.linears[:4], strict=True):
        assert g.rtn_error == pytest.approx(r.error, rel=1e-6), g.name


def test_awq_beats_rtn_where_a_few_input_channels_are_large(tmp_path):
    """Planted outliers (4 channels x 30 after every norm): AWQ's scaled and clipped rounding
    reconstructs q/k/v and gate/up clearly better than round to nearest."""
    src = tiny_folder(tmp_path / "float", outliers=30.0)
    opts = QuantizeOptions("awq", 4, 32, True, SAMPLES, SEQ_LEN, dtype=torch.float32)
    report = quantize(src, tmp_path / "awq", opts, log=lambda _: None)
    for r in report.linears:
        assert r.error <= r.rtn_error, r
        if r.name.endswith(("qkv_proj", "gate_up_proj")):
            assert r.error < 0.8 * r.rtn_error, r


def test_tokenmill_answers_as_transformers_on_the_folder(written):
    from tokenmill import LLM, SamplingParams

    folder = written["gptq"][0]
    prompts = ["Hello there, how are you today? I am", "1, 2, 3, 4,"]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        want.append(out[0, ids.shape[1] :].tolist())
    llm = LLM(str(folder), dtype="float32", progress=False, kv_cache_memory="16MiB", enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want


def test_from_a_gguf_the_folder_gets_its_config_tokenizer_and_chat_template(tmp_path):
    """A tiny F32 Llama GGUF with SmolLM2's tokenizer metadata: config.json says what the GGUF
    does, transformers' tokenizer from the folder encodes a chat as tokenmill's from the GGUF,
    and transformers loads the model."""
    from tokenmill.model.tokenizer import load_tokenizer

    hf = make_tiny_llama(tmp_path / "hf", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    gguf = tmp_path / "tiny.gguf"
    write_gguf(gguf, hf, "llama", gguf_tokenizer_metadata(default_model_path()))
    quantize(gguf, tmp_path / "out", QuantizeOptions("rtn", 4, 32, True, 2, 32), log=lambda _: None)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    want = hf.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert config[key] == getattr(want, key), key
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"
    ours = load_tokenizer(gguf)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    chat = [{"role": "user", "content": "Hello, what is 2 + 2?"}]
    text = ours.apply_chat_template(chat)
    assert theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == text
    assert theirs(text, add_special_tokens=False).input_ids == ours.encode(text, add_special_tokens=False)
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)


def test_group_size_falls_back_to_a_power_of_two_that_divides_the_width():
    assert [group_for(k, 128) for k in (1536, 576, 64, 100)] == [128, 64, 64, 100]
    assert group_for(576, 96) == 96  # divides: kept


def test_missing_library_is_named_with_its_install_line(tmp_path):
    code = (
        "import sys; sys.modules['compressed_tensors'] = None\n"
        "from tokenmill.entrypoints.cli import main\n"
        f"sys.exit(main(['quantize', {str(tmp_path / 'm')!r}, {str(tmp_path / 'out')!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "pip install 'tokenmill[quantize]'" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_default_model_quantised_from_its_gguf_answers_a_chat_prompt(tmp_path):
    """The bundled Q4_1 GGUF -> GPTQ W4A16 (group 128; its 576-wide layers take 64) -> a
    folder tokenmill loads and chats with; config, tokenizer and chat template come from
    the GGUF."""
    from tokenmill import LLM, SamplingParams

    out = tmp_path / "smol-gptq"
    cmd = [sys.executable, "-m", "tokenmill", "quantize", str(out), "--method", "gptq", "--bits", "4"]
    cmd += ["--group-size", "128", "--samples", "4", "--seq-len", "128"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layer 30/30" in done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    groups = {g["weights"]["group_size"]: g["targets"] for g in config["quantization_config"]["config_groups"].values()}
    assert groups == {64: [r"re:.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj)$"], 128: [r"re:.*\.(down_proj)$"]}
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    llm = LLM(str(out), progress=False, kv_cache_memory="64MiB")
    reply = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=24, temperature=0)
    )
    assert "Paris" in reply[0].outputs[0].text
