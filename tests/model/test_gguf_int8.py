"""GGUF weights in their own blocks with llama.cpp's integer arithmetic (quant/blocks.py,
csrc/ggml_ops.cpp; ``--quant-arithmetic int8``): the blocks hold gguf's numbers, the kernel
matches the pure-torch reference of the same arithmetic (on this machine's build and on the
AVX2-only one), a model reads its file's own bytes, and its tokens are the reference's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import gguf_tokenizer_metadata, make_tiny_llama, random_gguf_blocks, run_on_avx2_build, write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.native import load_native
from tokenmill.quant.blocks import (
    BLOCK_TYPES,
    GROUPED,
    INT8_MAX_ROWS,
    BlockWeight,
    int8_reference,
    quantise_activations,
)
from tokenmill.quant.packed import QuantLinear

pytestmark = pytest.mark.skipif(not load_native(), reason="native kernels did not build")

SHAPES = {t: [(37, 512), (6, 768)] if t.endswith("_K") else [(37, 576), (9, 224)] for t in BLOCK_TYPES}
ROWS = (1, 2, 3, 4, 5, 8, 13, INT8_MAX_ROWS, INT8_MAX_ROWS + 1, 70)  # tiles of 1-4, chunks of 32, the GEMM
GEMM_ROWS = INT8_MAX_ROWS + 1  # bfloat16 batches dequantised into the GEMM from here, where asked


def blocks(type_name: str, n: int, k: int, seed: int = 0, grouped: bool = False) -> tuple[BlockWeight, np.ndarray]:
    """Random blocks [n, k] and gguf's numbers for them; ``grouped``: as the native kernels take
    them (rows interleaved eight by eight where the type has group kernels), from two parts."""
    from gguf import GGMLQuantizationType, dequantize

    raw = random_gguf_blocks(type_name, n, k, seed)
    ref = dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k)
    if not grouped:
        return BlockWeight.from_gguf(type_name, raw, (n, k)), ref
    cut = n // 3
    parts = [
        BlockWeight.from_gguf(type_name, raw[:cut], (cut, k)),
        BlockWeight.from_gguf(type_name, raw[cut:], (n - cut, k)),
    ]
    joined = BlockWeight.for_native(parts)
    return (joined[0] if len(joined) == 1 else BlockWeight.cat(joined)), ref


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_blocks_hold_gguf_dequantized_values(type_name):
    """A block weight is the file's bytes; dequantised by the reference and by the native
    kernel (all rows, some rows, bfloat16) it is gguf's numbers to the bit."""
    for n, k in SHAPES[type_name]:
        w, ref = blocks(type_name, n, k)
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        assert w.qs.dtype == torch.uint8 and w.qs.shape == (n, k // block * size) and w.nbytes == w.qs.numel()
        np.testing.assert_array_equal(w.dequantize().numpy(), ref)
        ids = torch.tensor([n - 1, 0, n // 2])
        np.testing.assert_array_equal(w.dequantize_rows(ids).numpy(), ref[ids.numpy()])
        np.testing.assert_array_equal(w.dequantize_rows().numpy(), ref)
        assert torch.equal(w.dequantize_rows(bf16=True), torch.from_numpy(ref).bfloat16())


def check_block_linear(type_name: str, dtype: torch.dtype = torch.float32, grouped: bool = False) -> None:
    """The kernel against int8_reference (the same arithmetic in torch, float64 sums): 1e-5 of
    the output's scale in float32; and the int8 arithmetic within 3% of the float product.
    Each activation row's outputs are the same bits computed alone as in any batch, but for a
    bfloat16 batch told to dequantise into the GEMM (gemm_rows, here INT8_MAX_ROWS + 1)."""
    gemm_choices = (0, GEMM_ROWS) if dtype == torch.bfloat16 else (0,)
    for n, k in SHAPES[type_name]:
        w, ref = blocks(type_name, n, k, seed=n, grouped=grouped)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
            want = int8_reference(x, w)
            for gemm_rows in gemm_choices:
                got = torch.ops.tokenmill.block_linear(x, w.qs, w.type_code, gemm_rows)
                assert got.dtype == dtype and got.shape == (rows, n)
                if gemm_rows == 0 or rows < gemm_rows:
                    alone = torch.ops.tokenmill.block_linear(x[-1:], w.qs, w.type_code, gemm_rows)
                    assert torch.equal(alone, got[-1:]), f"{type_name} {n}x{k}: row {rows - 1} differs in {rows}"
                err = ((got.double() - want.double()).abs().max() / want.abs().max()).item()
                assert err < (1e-5 if dtype == torch.float32 else 8e-3), f"{type_name} {n}x{k} rows={rows}: {err}"
            exact = x.double() @ torch.from_numpy(ref).double().T
            assert ((want.double() - exact).abs().max() / exact.abs().max()).item() < 0.03


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_linear_matches_the_int8_reference(type_name, dtype):
    check_block_linear(type_name, dtype)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K"])
def test_two_groups_at_once_are_the_same_bits_as_one_group(type_name):
    """24 rows are three groups of eight: AVX-512 builds run the first two as a pair (one zmm
    register) in batches of 16 rows or more, and the third alone; with the rows rotated by a
    group the third's rows run in the pair. Each row's outputs are the same bits either way, and
    the same as in a batch of a few rows (no pairs); on builds with no pairs too."""
    k = 512 if type_name.endswith("_K") else 576
    raw = random_gguf_blocks(type_name, 24, k, seed=5)
    rotated = np.concatenate([raw[16:], raw[:16]])
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(1))
    outs = []
    for r in (raw, rotated):
        (w,) = BlockWeight.for_native([BlockWeight.from_gguf(type_name, r, (24, k))])
        assert w.grouped
        outs.append(torch.ops.tokenmill.block_linear(x, w.qs, w.type_code))
    assert torch.equal(outs[0], torch.cat([outs[1][:, 8:], outs[1][:, :8]], dim=1))
    few = torch.ops.tokenmill.block_linear(x[:3], w.qs, w.type_code)
    assert torch.equal(few, outs[1][:3])


def has_tiles(type_name: str) -> bool:
    return load_native() and torch.ops.tokenmill.block_has_tiles(BLOCK_TYPES[type_name])


@pytest.mark.skipif(not has_tiles("Q4_1"), reason="no AMX tiles in this CPU or build")
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K"])
def test_amx_tiles_are_the_same_bits_as_the_zmm_pair_kernel(type_name, monkeypatch):
    """On a CPU with AMX, batches take whole tiles of 16 activation rows (csrc/ggml_amx.cpp) and
    the zmm pair kernel the rest: every output is the same bits as with the tiles off
    (TOKENMILL_AMX=0) and as its row computed alone, whatever the batch around it."""
    k = 512 if type_name.endswith("_K") else 576
    raw = random_gguf_blocks(type_name, 37, k, seed=7)  # four groups (two pairs) and five single rows
    (w,) = BlockWeight.for_native([BlockWeight.from_gguf(type_name, raw, (37, k))])
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([torch.ops.tokenmill.block_linear(x[i : i + 1], w.qs, w.type_code) for i in range(70)])
    for rows in (16, 17, 31, 32, 33, 48, 70):
        monkeypatch.setenv("TOKENMILL_AMX", "1")
        tiles = torch.ops.tokenmill.block_linear(x[:rows], w.qs, w.type_code)
        monkeypatch.setenv("TOKENMILL_AMX", "0")
        pairs = torch.ops.tokenmill.block_linear(x[:rows], w.qs, w.type_code)
        assert torch.equal(tiles, pairs), rows
        assert torch.equal(tiles, alone[:rows]), rows


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_grouped_weights_dequantise_to_bfloat16_as_row_by_row(type_name):
    """The bfloat16 GEMM of long prefills dequantises grouped weights group by group, and Q6_K's
    plain rows sixteen values at a time (AVX-512 builds): the same bfloat16 values as the
    row-at-a-time path (rows asked by id take it), and as the float32 values rounded, the rows
    past the last whole group included."""
    k = 512 if type_name.endswith("_K") else 576
    (w,) = BlockWeight.for_native([BlockWeight.from_gguf(type_name, random_gguf_blocks(type_name, 37, k), (37, k))])
    code = w.type_code
    groups = torch.ops.tokenmill.block_dequantize(w.qs, code, k, None, True)
    rows = torch.ops.tokenmill.block_dequantize(w.qs, code, k, torch.arange(37), True)
    assert torch.equal(groups.view(torch.int16), rows.view(torch.int16))
    f32 = torch.ops.tokenmill.block_dequantize(w.qs, code, k, None, False)
    assert torch.equal(groups.view(torch.int16), f32.bfloat16().view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_on_the_int8_grid_are_the_torch_formula_bit_for_bit(dtype):
    """What the bfloat16 GEMM of long prefills multiplies (each block of 32 rounded to the 8-bit
    grid of its own scale) is the torch formula's numbers exactly: zero blocks, huge and tiny
    values, -0 included."""
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(3)) * torch.logspace(-4, 4, 576)
    x[3, :32] = 0
    x[4, 32:64] = -0.0
    x[5, 70] = 1e30
    x = x.to(dtype)
    xf = x.float().view(70, 18, 32)
    d = xf.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, d.reciprocal(), torch.zeros_like(d))
    expected = (torch.round(xf * inv).clamp(-127, 127) * d).view(70, 576).bfloat16()
    got = torch.ops.tokenmill.block_int8_grid(x, 32)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_q6_k_batches_in_bands_are_the_same_bits_as_each_row_alone():
    """Q6_K batches of 8 rows or more run sixteen activation rows to a register (the band kernel:
    zmm on AVX-512 builds with VNNI, two ymm halves on AVX2 builds) and what is left of a chunk a
    row at a time: every output is the same bits as its row's alone, whatever the batch (45 rows:
    a chunk of two bands, then a short band; 23: a band, then 7 rows a row at a time; 8 and 40: a
    last band of one half), for weights of fewer rows than a pass takes (5), split by the threads
    within a pass (21), and of whole passes (64). Rows of 4 super-blocks and of 7 (a row alone
    reduces four super-blocks' sums at a time: 7 is a four and a tail of three)."""
    for k in (1024, 1792):
        x = torch.randn(45, k, generator=torch.Generator().manual_seed(3))
        for n in (5, 21, 64):
            w = BlockWeight.from_gguf("Q6_K", random_gguf_blocks("Q6_K", n, k, seed=n), (n, k))
            alone = torch.cat([torch.ops.tokenmill.block_linear(x[i : i + 1], w.qs, w.type_code) for i in range(45)])
            for rows in (8, 16, 23, 32, 40, 45):
                got = torch.ops.tokenmill.block_linear(x[:rows], w.qs, w.type_code)
                assert torch.equal(got, alone[:rows]), f"{n}x{k} weight, a batch of {rows}"
            want = int8_reference(x, w)
            assert ((alone.double() - want.double()).abs().max() / want.abs().max()).item() < 1e-5


def test_a_quant_linear_gives_each_block_type_its_measured_gemm_rows():
    """QuantLinear.use_native hands each part the row count measured for its type (absent or
    None: never), and a bfloat16 batch from there is the GEMM's numbers, below it the dots'."""
    q4, _ = blocks("Q4_K", 16, 512)
    q6, _ = blocks("Q6_K", 8, 512, seed=1)
    layer = QuantLinear([q4, q6])
    layer.use_native(True, {"Q6_K": 40, "Q4_K": None})
    assert [p.gemm_rows for p in layer.parts] == [0, 40]
    x = torch.randn(48, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    six = layer.parts[1]
    assert torch.equal(layer(x)[:, 16:], torch.ops.tokenmill.block_linear(x, six.qs, six.type_code, 1))
    assert torch.equal(layer(x[:39])[:, 16:], torch.ops.tokenmill.block_linear(x[:39], six.qs, six.type_code, 0))
    assert not torch.equal(
        torch.ops.tokenmill.block_linear(x, six.qs, six.type_code, 1),
        torch.ops.tokenmill.block_linear(x, six.qs, six.type_code, 0),
    )
    plain = QuantLinear([blocks("Q4_K", 16, 512)[0]])  # no choices given: never
    plain.use_native(True)
    assert plain.parts[0].gemm_rows == 0


def test_only_the_rows_of_long_chunks_take_the_gemm_whatever_else_the_call_holds():
    """Given the step's long prompt chunks (``long_rows``), a weight multiplies in its GEMM only
    the chunks of at least its row count; every other row (decodes, short prompts, however many
    of them share the call) is the integer dots' bits, the same as computed alone."""
    q4, q6 = blocks("Q4_K", 16, 512)[0], blocks("Q6_K", 8, 512, seed=1)[0]
    layer = QuantLinear([q4, q6])
    layer.use_native(True, {"Q6_K": 40, "Q4_K": None})
    six = layer.parts[1]
    x = torch.randn(150, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    long_rows = ((3, 50), (60, 90), (100, 150))  # chunks of 47, 30 (short for Q6_K) and 50 rows
    got = layer(x, long_rows=long_rows)
    gemm = [(3, 50), (100, 150)]
    for a, b in gemm:
        assert torch.equal(got[a:b, 16:], torch.ops.tokenmill.block_linear(x[a:b], six.qs, six.type_code, 1)[:])
        assert not torch.equal(got[a:b, 16:], torch.ops.tokenmill.block_linear(x[a:b], six.qs, six.type_code, 0))
    for i in (0, 2, 50, 59, 60, 75, 89, 99):  # the dots, as alone
        assert torch.equal(
            got[i : i + 1, 16:], torch.ops.tokenmill.block_linear(x[i : i + 1], six.qs, six.type_code, 0)
        )
    assert torch.equal(got[:, :16], torch.ops.tokenmill.block_linear(x, q4.qs, q4.type_code, 0))  # Q4_K: never
    crowd = layer(x, long_rows=())  # 150 rows, no chunk long: every row the dots
    assert torch.equal(crowd[:, 16:], torch.ops.tokenmill.block_linear(x, six.qs, six.type_code, 0))
    assert torch.equal(layer(x, long_rows=((0, 150),)), layer(x))  # one chunk: the call's own rule


def check_grouped_rows(type_name: str) -> None:
    """Rows interleaved eight by eight (two parts joined, 37 or 9 rows: whole groups and a rest)
    are the parts' bytes, and read back (all rows, some, bfloat16) as gguf's numbers."""
    for n, k in SHAPES[type_name]:
        w, ref = blocks(type_name, n, k, grouped=True)
        plain, _ = blocks(type_name, n, k)
        assert w.grouped == (n >= 8 and torch.ops.tokenmill.block_has_groups(BLOCK_TYPES[type_name]))
        assert w.qs.shape == plain.qs.shape and torch.equal(w.plain_blocks(), plain.qs)
        assert not w.grouped or not torch.equal(w.qs, plain.qs)  # (the rows did move)
        ids = torch.tensor([n - 1, 0, n // 2, min(8, n - 1)])
        np.testing.assert_array_equal(w.dequantize_rows(ids).numpy(), ref[ids.numpy()])
        np.testing.assert_array_equal(w.dequantize_rows().numpy(), ref)
        assert torch.equal(w.dequantize_rows(bf16=True), torch.from_numpy(ref).bfloat16())


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_rows_grouped_eight_by_eight_are_the_same_bytes_and_numbers(type_name):
    check_grouped_rows(type_name)


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_kernels_match_the_int8_reference(type_name, dtype):
    check_block_linear(type_name, dtype, grouped=True)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_group_kernels_at_the_largest_integer_sums(type_name):
    """The 4-bit group kernels add a block's 32 products a row in 16-bit lanes before widening them
    (plain AVX2): at the largest sums there are (every nibble 15, every activation at +-127) the
    outputs are still the exact ones, 15 (Q4_1: 15 d + 0) or 7 (Q4_0: 15 - 8) times each row's sum."""
    n, k = 16, 576
    size = 20 if type_name == "Q4_1" else 18
    raw = np.zeros((n, k // 32, size), dtype=np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)  # d = 1 (Q4_1's m = 0)
    raw[:, :, size - 16 :] = 0xFF
    w = BlockWeight.for_native([BlockWeight.from_gguf(type_name, raw.reshape(n, -1), (n, k))])[0]
    x = torch.cat([torch.ones(3, k), -torch.ones(2, k), torch.linspace(-1, 1, k).expand(2, k)])
    got = torch.ops.tokenmill.block_linear(x, w.qs, w.type_code, 0)
    per_weight = 15.0 if type_name == "Q4_1" else 7.0
    want = int8_reference(x, w)
    assert torch.equal(got[:5], (per_weight * x[:5].sum(1, keepdim=True)).expand(5, n))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-4)


def test_activations_are_quantised_per_block_to_the_nearest_even():
    x = torch.tensor([[127.0, 0.5, -1.5, 2.5, -127.0, 0.0, 63.5, 1.0]])
    q, d = quantise_activations(x, 8)
    assert d.item() == 1.0
    assert q.reshape(-1).tolist() == [127, 0, -2, 2, -127, 0, 64, 1]
    zero_q, zero_d = quantise_activations(torch.zeros(1, 8), 8)
    assert zero_d.item() == 0 and not zero_q.any()


def test_bad_block_arguments_are_refused_by_name():
    w, _ = blocks("Q4_K", 4, 512)
    with pytest.raises(RuntimeError, match="is not served in its own blocks"):
        torch.ops.tokenmill.block_linear(torch.randn(1, 512), w.qs, 10)  # Q2_K
    with pytest.raises(RuntimeError, match="bytes, not"):
        torch.ops.tokenmill.block_linear(torch.randn(1, 256), w.qs, w.type_code)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.tokenmill.block_dequantize(w.qs, w.type_code, 512, torch.tensor([4]))
    q6, _ = blocks("Q6_K", 8, 512)
    with pytest.raises(RuntimeError, match="GGML type 14 has no eight-row layout"):
        torch.ops.tokenmill.block_linear(torch.randn(1, 512), q6.qs, BLOCK_TYPES["Q6_K"] | GROUPED)
    with pytest.raises(RuntimeError, match="not whole blocks of GGML type 12 of one width"):
        torch.ops.tokenmill.block_interleave([w.qs, blocks("Q4_K", 4, 256)[0].qs], BLOCK_TYPES["Q4_K"])


@pytest.mark.subprocess
def test_avx2_only_build_block_kernels_match_the_reference():
    """The -march=haswell build (what an AVX2-only CPU runs) passes the same checks."""
    run_on_avx2_build(
        "import tests.model.test_gguf_int8 as t\n"
        "for name in t.BLOCK_TYPES:\n"
        "    t.test_blocks_hold_gguf_dequantized_values(name)\n"
        "    t.check_block_linear(name)\n"
        "    t.check_grouped_rows(name)\n"
        "    t.check_block_linear(name, grouped=True)\n"
        "t.test_q6_k_batches_in_bands_are_the_same_bits_as_each_row_alone()\n"
    )


# --------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def int8_llm():
    return LLM(dtype="float32", progress=False, kv_cache_memory="64MiB")  # the default arithmetic: int8


def test_the_bundled_file_is_served_from_its_own_bytes(int8_llm):
    """By default, every linear of the Q4_1 model (Q8_0 embedding and tied head) reads the file's own
    blocks, 0.625 and 1.0625 bytes a weight, less than the float arithmetic's widened groups:
    interleaved eight rows at a time for the group kernels, one weight per projection."""
    from tokenmill.model.gguf_file import read_gguf
    from tokenmill.quant.weights import weight_bytes

    model = int8_llm.parts.model
    layer = model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear, QuantLinear) and linear.native
        assert linear.parts and all(type(p) is BlockWeight and p.source == "Q4_1" for p in linear.parts)
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert len(linear.parts) == 1 and linear.parts[0].grouped  # q, k, v (gate, up) joined in one copy
        grouped = linear.parts[0]
        linear.use_native(linear.bf16_gemm)  # again: the grouped weight stays as it is
        assert len(linear.parts) == 1 and linear.parts[0] is grouped
    assert isinstance(model.embed_tokens.weight, BlockWeight) and model.head_reads_embedding
    assert model.embed_tokens.weight.grouped  # the head's layout; lookups take rows out of their groups
    _, tensors = read_gguf(int8_llm.model_path)
    file_bytes = sum(t.data.nbytes for t in tensors if t.type_name in BLOCK_TYPES)
    served = {id(m): m.nbytes for m in model.modules() if isinstance(m, BlockWeight)}
    assert sum(served.values()) == file_bytes  # the quantised tensors, byte for byte
    float_llm = LLM(dtype="float32", quant_arithmetic="float", progress=False, kv_cache_memory="16MiB")
    assert weight_bytes(model) < 0.9 * weight_bytes(float_llm.parts.model)  # Q4_1: 0.625 bytes a weight, not 0.75


def test_int8_logits_do_not_depend_on_how_a_prompt_is_cut_into_steps(int8_llm):
    """Batch invariance, bit for bit: a 300-token text's logits are the same computed in one
    prefill (SDPA's size: the paged kernel here), in chunks of 37 and 64, and one token a step
    (the C++ decode loop), over contexts past one attention partition (256 keys). The int8
    arithmetic's activation rounding would turn any difference of float rounding into other
    tokens."""
    from tests.helpers import seq

    ids = int8_llm.tokenizer.encode((Path(__file__).parent.parent / "data" / "heldout.txt").read_text())[:300]
    runner, engine = int8_llm.parts.runner, int8_llm.engine

    def logits(step: int) -> torch.Tensor:
        outs = []
        with engine.core.borrow_blocks(-(-len(ids) // engine.core.block_size)) as blocks:
            for start in range(0, len(ids), step):
                piece = ids[start : start + step]
                outs.append(runner.all_logits([seq(piece, blocks, start, sample=False)]))
        return torch.cat(outs)

    whole = logits(len(ids))
    for step in (37, 64, 1):
        assert torch.equal(logits(step), whole), step


def test_a_short_prompts_bfloat16_logits_do_not_depend_on_the_rows_beside_it(monkeypatch):
    """Where the machine's probe dequantises the blocks into the bfloat16 GEMM (forced here from
    64 rows), a short prompt's logits are the same bits computed alone, in a step of six other
    short prompts (140 rows), and beside a 100-token prompt (a long chunk: the GEMM's): the
    choice is each sequence's, never the step's total rows."""
    from tests.helpers import seq

    monkeypatch.setenv("TOKENMILL_BLOCK_GEMM_ROWS", "64")
    llm = LLM(dtype="bfloat16", progress=False, kv_cache_memory="64MiB")
    assert llm.parts.model.ops.invariant_below == 64
    text = (Path(__file__).parent.parent / "data" / "heldout.txt").read_text()
    ids = llm.tokenizer.encode(text)
    short = [ids[20 * i : 20 * i + 20] for i in range(7)]
    runner, core = llm.parts.runner, llm.engine.core
    per_seq = -(-100 // core.block_size)

    def logits(prompts: list[list[int]]) -> torch.Tensor:
        with core.borrow_blocks(per_seq * len(prompts)) as blocks:
            seqs = [
                seq(p, blocks[i * per_seq : (i + 1) * per_seq], request_id=str(i), sample=False)
                for i, p in enumerate(prompts)
            ]
            return runner.all_logits(seqs)[:20]

    alone = logits(short[:1])
    assert torch.equal(logits(short), alone)
    assert torch.equal(logits([short[0], ids[200:300]]), alone)


def test_int8_decoding_perplexity_stays_within_one_percent_of_float(int8_llm):
    """Held-out English fed 8 tokens a step (decode-sized steps: the C++ layer loop and the
    integer kernels) through the real Q4_1 model: the activations' rounding costs under 1%
    of perplexity against the float arithmetic (measured: 14.442 vs 14.394, +0.3%). A wrong
    scale, min or nibble order anywhere costs far more."""
    from pathlib import Path

    from tokenmill.evaluate.perplexity import perplexity

    text = (Path(__file__).parent.parent / "data" / "heldout.txt").read_text()
    ids = int8_llm.tokenizer.encode(text)[:400]
    float_llm = LLM(dtype="float32", quant_arithmetic="float", progress=False, kv_cache_memory="32MiB")
    ours, theirs = perplexity(int8_llm, ids, chunk=8), perplexity(float_llm, ids, chunk=8)
    assert ours != theirs and abs(ours - theirs) / theirs < 0.01, (ours, theirs)


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q4_K", "Q5_K", "Q6_K"])  # (Q4_1 and Q8_0: the bundled file)
def test_tiny_gguf_in_blocks_scores_like_its_float_twin(tmp_path, int8_llm, weight_type):
    """A tiny Llama with every 2-D weight in one type (K-quants: random blocks), served from its
    blocks with int8 arithmetic: the log-probabilities it gives a 24-token prompt (int8-sized
    steps) are within 10% (0.05 absolute) of the same file's under float arithmetic."""
    hf = make_tiny_llama(
        tmp_path / "hf",
        vocab_size=int8_llm.config.vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    path = tmp_path / f"tiny-{weight_type}.gguf"
    write_gguf(path, hf, "llama", gguf_tokenizer_metadata(int8_llm.model_path), weight_type=weight_type)
    common = dict(dtype="float32", progress=False, kv_cache_memory="32MiB", enable_prefix_caching=False)
    blocks_llm, float_llm = (
        LLM(str(path), quant_arithmetic="int8", **common),
        LLM(str(path), quant_arithmetic="float", **common),
    )
    layer = blocks_llm.parts.model.layers[1]
    assert isinstance(layer.mlp.down_proj.parts[0], BlockWeight)
    # q, k and v (gate and up) one weight, whichever the type: the C++ layer loop takes the model
    assert len(layer.self_attn.qkv_proj.parts) == len(layer.mlp.gate_up_proj.parts) == 1
    assert blocks_llm.parts.model.fused_plan is not None
    prompt = "Hello there, how are you today? I am fine, thank you, and 1, 2, 3, 4, 5"
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    a, b = blocks_llm.generate([prompt], params)[0], float_llm.generate([prompt], params)[0]
    assert 16 <= len(a.prompt_token_ids) <= INT8_MAX_ROWS
    ours = a.prompt_logprobs[1:]
    theirs = b.prompt_logprobs[1:]
    assert ours != theirs
    np.testing.assert_allclose(ours, theirs, rtol=0.1, atol=0.05)  # (random K-quant blocks: logits of -20 to -50)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpp_layer_loop_over_contexts_of_several_partitions_is_bit_identical_to_the_python_loop(dtype):
    """The bundled file's decode steps in C++ (its layers in one team of threads; bfloat16
    activations rounded from each linear's float32 output as the separate calls round them)
    over contexts long enough for attention to split each into partitions (256 tokens) merged
    after: the logits equal the Python loop's to the bit, for one sequence and for three of
    different lengths."""
    from tests.helpers import fused_and_python_decode_logits

    llm = LLM(
        dtype=dtype, quant_arithmetic="int8", progress=False, kv_cache_memory="64MiB", enable_prefix_caching=False
    )
    assert llm.parts.model.fused_plan is not None
    text = (Path(__file__).parent.parent / "data" / "heldout.txt").read_text()
    ids = llm.tokenizer.encode(text)
    texts = [llm.tokenizer.decode(ids[:n]) for n in (600, 280, 40)]
    results = fused_and_python_decode_logits(llm, texts)
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpp_layer_loop_takes_block_weight_steps_of_up_to_32_tokens_bit_identical_to_the_python_loop(dtype):
    """Where every linear is in GGUF blocks, steps of up to 32 tokens run in C++ (batched decode,
    short chunks beside decodes), in one team of threads for float32 and bfloat16 activations: a
    step of 12 sequences' next tokens, and one of a 20-token chunk continuing a prompt beside two
    decodes, give the Python loop's logits to the bit."""
    from tests.helpers import all_logits, seq

    llm = LLM(
        dtype=dtype, quant_arithmetic="int8", progress=False, kv_cache_memory="64MiB", enable_prefix_caching=False
    )
    model, runner, pool = llm.parts.model, llm.engine.core.runner, llm.engine.core.block_pool
    assert model.fused_plan is not None and model.fused_plan.blocks_only
    ops, calls = model.ops, []
    loop = ops.decoder_layers
    ops.decoder_layers = lambda *a: calls.append(loop(*a)) or calls[-1]  # records whether C++ took the step
    prompts = [llm.tokenizer.encode(f"Sequence number {i} says hello to") for i in range(12)]
    tables = [pool.allocate(4) for _ in prompts]
    try:
        for ids, blocks in zip(prompts, tables, strict=True):
            all_logits(runner, [seq(ids, blocks)])
        results = {}
        for fused in (True, False):
            model._fused_plan = False if fused else None  # None: the Python loop
            calls.clear()
            twelve = all_logits(
                runner,
                [
                    seq([7 + i], blocks, num_computed=len(ids))
                    for i, (ids, blocks) in enumerate(zip(prompts, tables, strict=True))
                ],
            )
            chunk = all_logits(
                runner,
                [
                    seq(range(100, 120), tables[0], num_computed=len(prompts[0]) + 1),
                    *(seq([5], tables[i], num_computed=len(prompts[i]) + 1) for i in (1, 2)),
                ],
            )
            assert len(calls) == (2 if fused else 0) and all(c is not None for c in calls)
            results[fused] = (twelve, chunk)
    finally:
        model._fused_plan = False
        del ops.decoder_layers
        for blocks in tables:
            pool.free(blocks)
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])


def test_cpp_layer_loop_runs_block_weights_bit_identical_to_the_python_loop():
    """Decode steps in C++ (decode_layers) over block weights, one layer's qkv made of two
    block types as Q4_K_M files have it (q and k in one, v in another: here Q4_1 and Q8_0,
    SmolLM2's rows of 576 being too short for K-quants): the logits equal the Python loop's
    to the bit, for one sequence and for three."""
    from tests.helpers import fused_and_python_decode_logits

    llm = LLM(dtype="float32", quant_arithmetic="int8", progress=False, kv_cache_memory="32MiB")
    model = llm.parts.model
    attn = model.layers[1].self_attn
    kv_rows = attn.num_kv_heads * attn.head_dim
    q_k = attn.qkv_proj.parts[0].rows(torch.arange((attn.num_heads + attn.num_kv_heads) * attn.head_dim))  # q and k
    v = BlockWeight.from_gguf(
        "Q8_0", random_gguf_blocks("Q8_0", kv_rows, q_k.in_features, 5), (kv_rows, q_k.in_features)
    )
    mixed = QuantLinear([q_k, v])
    mixed.use_native(attn.qkv_proj.bf16_gemm)
    attn.qkv_proj = mixed
    model.reset_fused_plan()
    assert model.fused_plan is not None and len(mixed.parts) == 2 and all(p.grouped for p in mixed.parts)
    results = fused_and_python_decode_logits(llm)
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
