"""GGUF quantised blocks served natively (quant/packed.py, csrc/quant_ops.cpp): every type's
repacking holds gguf's own dequantised numbers, every kernel matches the pure-torch
reference (on this machine's build and on the AVX2-only one), and models served from their
blocks give the dequantised path's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import gguf_tokenizer_metadata, make_tiny_llama, random_gguf_blocks, run_on_avx2_build, write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.native import load_native
from tokenmill.quant.packed import NATIVE_GGUF_TYPES, PackedWeight, QuantEmbedding, QuantLinear

pytestmark = pytest.mark.skipif(not load_native(), reason="native kernels did not build")

# (out, in) shapes per type: K-quants need rows of 256; the others include a row whose
# length is 32 mod 64 (a half chunk of the 4-bit layout) and an output count not a multiple of 4.
SHAPES = {t: [(37, 512), (6, 768)] if t.endswith("_K") else [(37, 576), (9, 224), (64, 96)] for t in NATIVE_GGUF_TYPES}
ROWS = (1, 2, 3, 4, 5, 8, 13)  # the GEMV tiles and the blocked kernel, on both builds


def packed(type_name: str, n: int, k: int, seed: int = 0) -> tuple[PackedWeight, np.ndarray]:
    from gguf import GGMLQuantizationType, dequantize

    raw = random_gguf_blocks(type_name, n, k, seed)
    return PackedWeight.from_gguf(type_name, raw, (n, k)), dequantize(raw, GGMLQuantizationType[type_name]).reshape(
        n, k
    )


@pytest.mark.parametrize("type_name", NATIVE_GGUF_TYPES)
def test_repacked_blocks_hold_gguf_dequantized_values(type_name):
    """The (q, scale, min) form is exact: dequantised by our reference and by the native
    kernel it gives gguf's numbers to the bit."""
    for n, k in SHAPES[type_name]:
        w, ref = packed(type_name, n, k)
        np.testing.assert_array_equal(w.dequantize().numpy(), ref)
        ids = torch.tensor([n - 1, 0, n // 2])
        np.testing.assert_array_equal(w.dequantize_rows(ids).numpy(), ref[ids.numpy()])
        np.testing.assert_array_equal(w.dequantize_rows().numpy(), ref)
        assert torch.equal(w.dequantize_rows(bf16=True), torch.from_numpy(ref).bfloat16())


def check_quant_linear(type_name: str, dtype: torch.dtype = torch.float32) -> None:
    """quant_linear against x @ W^T in float64 with gguf's dequantised W (float32: 1e-5 of
    the output's scale; bfloat16 output: its rounding)."""
    for n, k in SHAPES[type_name]:
        w, ref = packed(type_name, n, k, seed=n)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
            got = torch.ops.tokenmill.quant_linear(x, w.qs, w.scale, w.minv, w.bits, w.group)
            want = x.double() @ torch.from_numpy(ref).double().T
            assert got.dtype == dtype and got.shape == (rows, n)
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert err < (1e-5 if dtype == torch.float32 else 8e-3), f"{type_name} {n}x{k} rows={rows}: {err}"


@pytest.mark.parametrize("type_name", NATIVE_GGUF_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_matches_the_dequantized_reference(type_name, dtype):
    check_quant_linear(type_name, dtype)


@pytest.mark.parametrize("rows", [9, 64, 130, 300])
def test_batches_and_prefill_match_the_reference(rows):
    """Decode batches (weight rows unpacked into L1) and prefills (the weight dequantised for
    the call into the GEMM), past each build's cross-overs: the same numbers as the reference."""
    w, ref = packed("Q4_K", 600, 512)
    layer = QuantLinear([w])
    x = torch.randn(rows, 512)
    want = x.double() @ torch.from_numpy(ref).double().T
    for native in (True, False):  # the native kernels, then the torch reference
        layer.native = native
        err = ((layer(x).double() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, (native, err)


def test_a_projection_fused_from_mixed_types_keeps_each_part():
    """Q4_K_M files mix Q4_K and Q6_K inside one fused projection (q, k in Q4_K, v in Q6_K):
    each layout stays its own weight, the outputs side by side in order."""
    (q, rq), (k, rk), (v, rv) = packed("Q4_K", 64, 256), packed("Q4_K", 32, 256, 1), packed("Q6_K", 32, 256, 2)
    layer = QuantLinear([q, k, v], bias=torch.arange(128, dtype=torch.float32))
    layer.use_native(bf16_gemm=False)
    assert len(layer.parts) == 2 and layer.out_features == 128  # q and k merged: one layout
    x = torch.randn(3, 256)
    want = x.double() @ torch.from_numpy(np.concatenate([rq, rk, rv])).double().T + torch.arange(128).double()
    assert ((layer(x).double() - want).abs().max() / want.abs().max()).item() < 1e-5


def test_quantised_embedding_lookup_and_bad_ids():
    w, ref = packed("Q8_0", 50, 64)
    emb = QuantEmbedding(w, torch.bfloat16)
    ids = torch.tensor([[3, 49], [0, 3]])
    assert torch.equal(emb(ids), torch.from_numpy(ref)[ids].bfloat16())
    with pytest.raises(RuntimeError, match="out of range"):
        emb(torch.tensor([50]))


def test_bad_packed_arguments_are_refused_by_name():
    w, _ = packed("Q4_1", 8, 64)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        torch.ops.tokenmill.quant_linear(torch.randn(1, 64), w.qs, w.scale, w.minv, 5, 32)
    with pytest.raises(RuntimeError, match="bytes per row"):
        torch.ops.tokenmill.quant_linear(torch.randn(1, 128), w.qs, w.scale, w.minv, 4, 32)


# --------------------------------------------------------------------------- models


def test_the_default_serves_the_bundled_q4_1_file_from_its_blocks(llm):
    """The default model (Q4_1, Q8_0 embedding) loads as blocks: every linear is a
    QuantLinear on the native kernels, and the weights take about a third of float32's."""
    model = llm.parts.model
    assert isinstance(model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    layer = model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear, QuantLinear) and linear.native and linear.parts[0].source == "Q4_1"
    assert model.head_reads_embedding
    from tokenmill.quant.weights import weight_bytes

    params = 134_515_008  # SmolLM2-135M
    assert weight_bytes(model) < 0.3 * params * 4


def test_native_blocks_are_greedy_identical_to_the_dequantized_path(float_llm):
    """The real Q4_1 model, float32, float arithmetic: served from its blocks == dequantised to
    float32 at load."""
    llm = float_llm
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    ref = LLM(dtype="float32", quantization="none", progress=False, kv_cache_memory="64MiB")
    assert type(ref.parts.model.layers[0].mlp.down_proj).__name__ == "NativeLinear"
    assert [o.token_ids for o in ref.generate(prompts, params)] == ours


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"])
def test_tiny_gguf_of_each_type_matches_its_dequantized_twin(tmp_path, llm, weight_type):
    """A tiny Llama written with every 2-D weight in one type (the K-quants as random blocks):
    served from the file's own blocks with the float arithmetic (F16/BF16: 16-bit weights under
    float32 compute; the int8 arithmetic: test_gguf_int8), the log-probabilities of 24 greedy tokens are within 3e-4 of the dequantised float32 model's,
    and the tokens equal."""
    hf = make_tiny_llama(
        tmp_path / "hf",
        vocab_size=llm.config.vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    path = tmp_path / f"tiny-{weight_type}.gguf"
    write_gguf(path, hf, "llama", gguf_tokenizer_metadata(llm.model_path), weight_type=weight_type)
    common = dict(dtype="float32", progress=False, kv_cache_memory="32MiB", enable_prefix_caching=False)
    native, ref = LLM(str(path), quant_arithmetic="float", **common), LLM(str(path), quantization="none", **common)
    down = native.parts.model.layers[1].mlp.down_proj
    if weight_type.startswith(("F", "B")):
        assert down.weight.dtype == getattr(torch, {"F16": "float16", "BF16": "bfloat16"}[weight_type])
        assert native.parts.model.embed_tokens.weight.dtype == down.weight.dtype
    else:
        assert isinstance(down, QuantLinear)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    prompts = ["Hello there, how are you today? I am", "1, 2, 3, 4,"]
    a, b = native.generate(prompts, params), ref.generate(prompts, params)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        # two float32 sums in different orders (the blocks' kernels; the twin's prefill through the
        # GEMM tiles): 2.2e-4 apart at worst here (Q6_K), where a wrong block would be ~1 off
        np.testing.assert_allclose(x.outputs[0].logprobs, y.outputs[0].logprobs, rtol=3e-4, atol=3e-4)


def test_quantization_none_and_torch_kernels_dequantize_at_load():
    none = LLM(dtype="float32", quantization="none", progress=False, kv_cache_memory="16MiB")
    assert not any(isinstance(m, QuantLinear) for m in none.parts.model.modules())
    torch_ops = LLM(dtype="float32", kernels="torch", progress=False, kv_cache_memory="16MiB")
    assert not any(isinstance(m, QuantLinear) for m in torch_ops.parts.model.modules())


@pytest.mark.subprocess
def test_avx2_only_build_quant_kernels_match_the_reference():
    """The -march=haswell build (what an AVX2-only CPU runs) passes the same kernel checks."""
    run_on_avx2_build(
        "import tests.model.test_gguf_native as t\n"
        "for name in t.NATIVE_GGUF_TYPES:\n"
        "    t.test_repacked_blocks_hold_gguf_dequantized_values(name)\n"
        "    t.check_quant_linear(name)\n"
        "t.check_quant_linear('Q4_1', torch.bfloat16)\n"
        "t.test_batches_and_prefill_match_the_reference(130)\n"
        "t.test_bfloat16_batches_multiply_a_bfloat16_weight()\n"
    )


def test_bfloat16_batches_multiply_a_bfloat16_weight():
    """Under bfloat16 compute on a CPU with native bfloat16 units, batches past EXACT_BF16_ROWS
    multiply the weight rounded to bfloat16 (the dequantised bfloat16 model's own weights): in
    the blocked kernel's bfloat16 dot products (20 rows; a width of 16 mod 32 ends in a masked
    load) and through the GEMM (40 rows)."""
    from tokenmill.quant.packed import Decomposed

    q8 = np.random.default_rng(0).integers(-128, 128, (70, 48)).astype(np.int8)
    scales = np.random.default_rng(1).random((70, 3)).astype(np.float32) / 64
    tail = PackedWeight.from_decomposed(Decomposed(q8, scales, None, 8, 16), "int8")
    for w in (packed("Q4_1", 300, 576)[0], tail):
        layer = QuantLinear([w])
        layer.use_native(bf16_gemm=True)
        for rows in (20, 40):
            x = torch.randn(rows, w.in_features).bfloat16()
            want = x.float() @ w.dequantize().bfloat16().float().T
            got = layer(x)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2 * want.abs().max().item())


def test_perplexity_from_the_blocks_equals_the_dequantized_model(float_llm):
    """Held-out English through the paged cache: the Q4_1 model from its blocks (float
    arithmetic) and the same file dequantised to float32 agree to 1e-4 (the issue's bound is
    0.5%)."""
    llm = float_llm
    from pathlib import Path

    from tokenmill.evaluate.perplexity import perplexity

    text = (Path(__file__).parent.parent / "data" / "heldout.txt").read_text()
    ids = llm.tokenizer.encode(text)[:512]
    ref = LLM(dtype="float32", quantization="none", progress=False, kv_cache_memory="32MiB")
    ours, theirs = perplexity(llm, ids), perplexity(ref, ids)
    assert abs(ours - theirs) / theirs < 1e-4, (ours, theirs)


@pytest.mark.subprocess
def test_loading_a_model_does_not_import_the_compiler_stack():
    """A load builds the model on the meta device and adopts the file's tensors: no random
    init there, whose meta implementation imports torch._dynamo (~1 s of every load)."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom tokenmill import LLM\n"
        "LLM(progress=False, kv_cache_memory='16MiB')\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout
