"""The native CPU kernels against their pure-torch reference twins (tokenmill.model.ops).

Paged attention over random block tables, GQA, contexts of 1 to 4k tokens, every KV
storage dtype, prefix hits (chunks after a cached prefix), several query tokens a
sequence (speculative verification) and mixed batches; the fused RMSNorm/residual,
SiLU-and-multiply and RoPE-with-cache-write ops; the fallback when no compiler exists.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import run_on_avx2_build
from tokenmill.kernels.native import load_native
from tokenmill.model.layers.attention import AttentionMetadata
from tokenmill.model.layers.kv_cache import KVCacheLayer
from tokenmill.model.layers.rotary import RotaryEmbedding, inverse_frequencies
from tokenmill.model.ops import NativeOps, TorchOps, select_ops
from tokenmill.quant.kv import QUANTIZED_KV, SCALE_DTYPE

BS = 16
NATIVE, REF = NativeOps(), TorchOps()


@pytest.fixture(scope="module", autouse=True)
def native_built():
    assert load_native(), "the native CPU kernels must build on every supported machine (g++ and ninja)"


def make_cache(kind: str, num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> KVCacheLayer:
    shape = (num_blocks, BS, kv_heads, head_dim)
    if kind in QUANTIZED_KV:
        storage = QUANTIZED_KV[kind][0]
        return KVCacheLayer(
            torch.zeros(shape, dtype=storage),
            torch.zeros(shape, dtype=storage),
            dtype,
            kind,
            torch.ones(shape[:3], dtype=SCALE_DTYPE),
            torch.ones(shape[:3], dtype=SCALE_DTYPE),
        )
    storage = {"auto": dtype, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[kind]
    return KVCacheLayer(torch.zeros(shape, dtype=storage), torch.zeros(shape, dtype=storage), dtype)


def batch(specs, heads, kv_heads, head_dim, kind, dtype, seed=0):
    """specs: (context_len, new_tokens) per sequence, decodes (new=1) first. Fills the cache
    with every sequence's K/V, returns (q, k_new, v_new, cache, meta)."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-ctx // BS) for ctx, _ in specs)
    perm = torch.randperm(need + 7, generator=g).tolist()  # scattered, non-overlapping blocks
    cache = make_cache(kind, need + 7, kv_heads, head_dim, dtype)
    tables, qsl, lens, slots, ks, vs = [], [0], [], [], [], []
    for ctx, new in specs:
        table = [perm.pop() for _ in range(-(-ctx // BS))]
        k = torch.randn(ctx, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(ctx, kv_heads, head_dim, generator=g).to(dtype)
        seq_slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(ctx)])
        cache.write(k, v, seq_slots)
        tables.append(table)
        qsl.append(qsl[-1] + new)
        lens.append(ctx)
        slots.append(seq_slots[ctx - new :])
        ks.append(k[ctx - new :])
        vs.append(v[ctx - new :])
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        query_start_loc=qsl,
        seq_lens_host=lens,
        num_decodes=sum(1 for _, new in specs if new == 1),
        block_size=BS,
        block_tables_host=tables,
    )
    q = torch.randn(qsl[-1], heads, head_dim, generator=g).to(dtype)
    return q, torch.cat(ks), torch.cat(vs), cache, meta


def check_attention(
    specs,
    heads=8,
    kv_heads=2,
    head_dim=64,
    kind="auto",
    dtype=torch.float32,
    seed=0,
    window=None,
    softcap=None,
    ops=NATIVE,
):
    q, k, v, cache, meta = batch(specs, heads, kv_heads, head_dim, kind, dtype, seed)
    scale = head_dim**-0.5
    ref = REF.attention(q, k, v, cache, meta, scale, window, softcap).float()
    out = ops.attention(q, k, v, cache, meta, scale, window, softcap).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


DECODES = [(1, 1), (15, 1), (16, 1), (17, 1), (300, 1), (1000, 1)]


@pytest.mark.parametrize("kind", ["auto", "float32", "bfloat16", "float16", "int8", "fp8"])
def test_decodes_every_kv_dtype(kind):
    check_attention(DECODES, kind=kind)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 8, 64), (8, 2, 64), (9, 3, 64), (4, 1, 32), (6, 2, 128)])
def test_gqa_shapes(heads, kv_heads, head_dim):
    check_attention([(5, 1), (77, 1), (40, 8), (33, 33)], heads, kv_heads, head_dim)


def test_long_contexts_split_across_threads():
    # 4,096 tokens = 16 FlashDecoding partitions a head, merged by their softmax statistics.
    check_attention([(4096, 1), (2500, 1), (4000, 3)], heads=9, kv_heads=3)


def test_prefix_hits_and_speculative_verification():
    # chunks after a cached prefix (prefix-cache hits, chunked prefill), a few query tokens
    # each (draft verification), straddling block edges, next to decodes
    check_attention([(3, 1), (129, 1), (20, 5), (48, 16), (700, 4), (1100, 90), (31, 31)], heads=9, kv_heads=3)


def test_long_prefill_chunk_over_a_long_context():
    # a chunk of 300 queries after 2,300 cached tokens: in the paged kernel (batch-invariant
    # steps take every chunk there) cut into runs of queries, each run's keys (up to its last
    # query) split into partitions and merged; else SDPA's flash kernel twice, merged
    for ops in (NativeOps(batch_invariant=True), NATIVE):
        check_attention([(1, 1), (2600, 300), (515, 512)], heads=9, kv_heads=3, ops=ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_chunks_over_a_cached_context_take_flash_attention_twice_merged(dtype):
    """A chunk of at least 64 new tokens over a cached context (a long prompt's second chunk and
    on) runs SDPA's flash kernel over the context and over its own K/V, merged by the two
    log-sum-exps: the reference's numbers within float tolerance, grouped heads included, and
    shorter chunks, decodes, windows and quantised caches still read by the paged kernel."""
    specs = [(5, 1), (2600, 300), (130, 64), (400, 63), (90, 90)]
    q, k, v, cache, meta = batch(specs, 9, 3, 64, "auto" if dtype == torch.float32 else "bfloat16", dtype, seed=7)
    index = meta.kernel_index(64, 64)
    assert index.context_seqs == [1, 2] and index.fresh_seqs == [4] and index.paged_seq_ids.tolist() == [0, 3]
    check_attention(specs, heads=9, kv_heads=3, dtype=dtype, kind="auto" if dtype == torch.float32 else "bfloat16")
    check_attention([(2600, 300)], heads=8, kv_heads=2, head_dim=128, dtype=dtype)
    assert meta.kernel_index(64, None).context_seqs == []  # (windows, soft caps, quantised caches)
    check_attention([(2600, 300), (700, 100)], heads=9, kv_heads=3, window=100)
    check_attention([(2600, 300)], heads=9, kv_heads=3, kind="int8")


@pytest.mark.parametrize("window,softcap", [(100, None), (16, None), (None, 50.0), (64, 30.0)])
def test_sliding_windows_and_soft_capping(window, softcap):
    """Mistral's sliding window and Gemma 2's soft-capped scores in the kernel: decodes past the
    window, chunks straddling it, fresh prefills longer than it, against the reference."""
    specs = [(1, 1), (99, 1), (100, 1), (101, 1), (1000, 1), (700, 4), (1100, 90), (2600, 300), (40, 40), (300, 300)]
    check_attention(specs, heads=9, kv_heads=3, window=window, softcap=softcap)
    check_attention([(500, 1), (90, 7)], heads=9, kv_heads=3, kind="int8", window=window, softcap=softcap)


@pytest.mark.parametrize("block_size", [8, 32, 48])
def test_block_sizes_other_than_one_vector_of_keys(block_size, monkeypatch):
    """The kernel scores keys 16 at a time (one AVX-512 vector): blocks of 8 (a part vector), 32
    (two) and 48 tokens, with windows and chunks cutting them anywhere, against the reference."""
    monkeypatch.setattr(sys.modules[__name__], "BS", block_size)
    specs = [(1, 1), (15, 1), (17, 1), (300, 1), (47, 5), (1100, 90), (33, 33)]
    check_attention(specs, heads=9, kv_heads=3, kind="bfloat16", dtype=torch.bfloat16)
    check_attention(specs, heads=9, kv_heads=3, window=20)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 1, 32)])
def test_attention_of_a_query_does_not_depend_on_its_step(heads, kv_heads, head_dim):
    """Batch invariance of the kernel: a query's output is bit-identical whether it is a lone
    decode or one row of a long prefill chunk beside other sequences (NativeOps(batch_invariant)),
    on the bfloat16 dot products (64- and 128-wide heads) and the float path (32)."""
    ops = NativeOps(batch_invariant=True)
    q, k, v, cache, meta = batch(
        [(40, 1), (600, 100), (300, 1)], heads, kv_heads, head_dim, "bfloat16", torch.bfloat16, seed=3
    )
    together = ops.attention(q, k, v, cache, meta, head_dim**-0.5)
    # the chunk's last query alone: the same cache, a one-query step
    width = meta.block_tables.shape[1]
    alone = AttentionMetadata(
        slot_mapping=meta.slot_mapping[100:101],
        block_tables=meta.block_tables[1:2, :width],
        query_start_loc=[0, 1],
        seq_lens_host=[600],
        num_decodes=1,
        block_size=BS,
        block_tables_host=[meta.block_tables_host[1]],
    )
    single = ops.attention(q[100:101], k[100:101], v[100:101], cache, alone, head_dim**-0.5)
    assert torch.equal(single[0], together[100])


@pytest.mark.parametrize("groups", [3, 5, 7])
def test_a_query_head_has_the_same_bits_whatever_its_kv_head_shares(groups):
    """Query heads that share a KV head are scored together (AVX2: threes and twos reading each key
    once), which must change no output: each head's bits are those it gets where its KV head serves
    two heads (the paired ones) or one (an odd last one), on one float32 step of decodes, a chunk
    over a cached context and a fresh prompt. In a batch-invariant step (partitions of one size; a
    step that is not may split a context by its load, which the head count is part of). Tested on
    the AVX2 build too."""
    kv_heads, specs = 2, [(1, 1), (77, 1), (300, 1), (700, 40), (90, 90)]
    q, k, v, cache, meta = batch(specs, kv_heads * groups, kv_heads, 64, "auto", torch.float32, seed=5)
    ops = NativeOps(batch_invariant=True)
    out = ops.attention(q, k, v, cache, meta, 0.125).view(len(q), kv_heads, groups, 64)
    heads = q.view(len(q), kv_heads, groups, 64)
    paired = groups - groups % 2
    for rows in ([0, 1], [paired - 2, paired - 1], [groups - 1]):
        alone = heads[:, :, rows].reshape(len(q), kv_heads * len(rows), 64).contiguous()
        ref = ops.attention(alone, k, v, cache, meta, 0.125).view(len(q), kv_heads, len(rows), 64)
        assert torch.equal(out[:, :, rows], ref), (groups, rows)


def test_only_long_fresh_prefills_take_sdpa_and_every_other_sequence_reads_as_in_any_step():
    """Where the machine's probe multiplies GGUF blocks in the dequantised GEMM from some row count
    (``invariant_below``), a fresh prompt of that many tokens has numbers of its own already: it
    takes SDPA, as a float model's does. Every other sequence (a decode, a short prompt) keeps the
    paged kernel's bits whatever its step holds: a crowd of short prompts as many rows as a long
    one changes nothing."""
    invariant, sdpa = NativeOps(batch_invariant=True), NativeOps()
    chosen = NativeOps(batch_invariant=True, invariant_below=128)
    q, k, v, cache, meta = batch([(300, 1), (200, 200)], 9, 3, 64, "bfloat16", torch.bfloat16, seed=4)
    got = chosen.attention(q, k, v, cache, meta, 0.125)
    assert torch.equal(got[1:], sdpa.attention(q, k, v, cache, meta, 0.125)[1:])
    assert not torch.equal(got[1:], invariant.attention(q, k, v, cache, meta, 0.125)[1:])
    assert torch.equal(got[:1], invariant.attention(q, k, v, cache, meta, 0.125)[:1])
    for specs in ([(300, 1), (100, 100)], [(300, 1), *[(60, 60)] * 4]):  # 101 rows; 241 rows, none long
        q, k, v, cache, meta = batch(specs, 9, 3, 64, "bfloat16", torch.bfloat16, seed=4)
        assert torch.equal(
            chosen.attention(q, k, v, cache, meta, 0.125), invariant.attention(q, k, v, cache, meta, 0.125)
        )


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_bfloat16_queries_over_a_bfloat16_cache_at_every_head_width(head_dim):
    """bfloat16 queries over a bfloat16 cache run on the CPU's bfloat16 dot products where it has
    them (64- and 128-wide heads; the softmax weights rounded to bfloat16), the float path
    otherwise: decodes, chunks over a cached context, fresh prompts, windows and soft caps, all
    within bfloat16's tolerance of the float reference."""
    specs = [(1, 1), (17, 1), (300, 1), (47, 5), (1100, 90), (33, 33), (200, 200)]
    check_attention(specs, heads=8, kv_heads=2, head_dim=head_dim, kind="bfloat16", dtype=torch.bfloat16)
    check_attention(
        specs, heads=9, kv_heads=3, head_dim=head_dim, kind="bfloat16", dtype=torch.bfloat16, window=20, softcap=30.0
    )


def test_fresh_prefills_long_and_short():
    check_attention([(10, 10), (200, 200), (63, 63), (64, 64)], heads=9, kv_heads=3)


@pytest.mark.parametrize("kind", ["auto", "bfloat16", "int8", "fp8"])
def test_bfloat16_queries(kind):
    check_attention(DECODES + [(90, 7), (400, 400)], heads=9, kv_heads=3, kind=kind, dtype=torch.bfloat16)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed):
    g = torch.Generator().manual_seed(100 + seed)
    n = int(torch.randint(1, 12, (1,), generator=g))
    specs = []
    for _ in range(n):
        ctx = int(torch.randint(1, 1500, (1,), generator=g))
        new = 1 if torch.rand(1, generator=g) < 0.6 else int(torch.randint(1, ctx + 1, (1,), generator=g))
        specs.append((ctx, new))
    specs.sort(key=lambda s: s[1] != 1)  # decodes first, as the runner orders them
    check_attention(specs, heads=9, kv_heads=3, seed=seed)


# ---------------------------------------------------------------- the fused small ops


def close(a, b, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    else:  # the same roundings: equal but for a rare last-bit difference in a float32 sum
        assert (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max()
        assert (a != b).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_residual_add(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=g).to(dtype)
    res = torch.randn(37, 576, generator=g).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    close(NATIVE.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5), dtype)
    r1, r2 = res.clone(), res.clone()
    y1, y2 = NATIVE.add_rms_norm(x, r1, w, 1e-5), REF.add_rms_norm(x, r2, w, 1e-5)
    assert torch.equal(r1, r2)  # the residual stream itself is exact
    close(y1, y2, dtype)


@pytest.mark.parametrize(
    "dtype,kind",
    [
        (torch.float32, "auto"),
        (torch.bfloat16, "auto"),
        (torch.float32, "bfloat16"),
        (torch.float32, "int8"),
        (torch.bfloat16, "fp8"),
    ],
)
def test_rotary_with_cache_write(dtype, kind):
    g = torch.Generator().manual_seed(2)
    rotary = RotaryEmbedding(inverse_frequencies(64, 100000.0, None), 2048)
    n, heads, kv_heads = 13, 9, 3
    qkv = torch.randn(n, (heads + 2 * kv_heads) * 64, generator=g).to(dtype)
    positions = torch.randint(0, 2048, (n,), generator=g)
    slots = torch.randperm(8 * BS, generator=g)[:n]
    outs = []
    for ops in (NATIVE, REF):
        q, k, v = qkv.clone().split([heads * 64, kv_heads * 64, kv_heads * 64], dim=-1)  # strided views, as the model's
        q, k, v = q.view(n, heads, 64), k.view(n, kv_heads, 64), v.view(n, kv_heads, 64)
        cache = make_cache(kind, 8, kv_heads, 64, dtype)
        q, k = ops.rotary_write_kv(q, k, v, positions, rotary, cache, slots)
        outs.append((q, k, cache))
    (q1, k1, c1), (q2, k2, c2) = outs
    close(q1, q2, dtype)
    close(k1, k2, dtype)
    for a, b in ((c1.k, c2.k), (c1.v, c2.v)):
        close(a.float(), b.float(), dtype if kind == "auto" else torch.bfloat16)


def test_model_level_greedy_identity_real_model():
    """The bundled model, float32, float arithmetic: native and reference paths produce the same tokens
    for a batch of fresh prompts, prefix hits and long decodes."""
    from tokenmill import LLM, SamplingParams

    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "The capital of France is a"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = []
    for kernels in ("torch", "native"):
        llm = LLM(dtype="float32", kernels=kernels, quant_arithmetic="float", progress=False, kv_cache_memory="64MiB")
        assert type(llm.parts.model.ops).__name__ == ("TorchOps" if kernels == "torch" else "NativeOps")
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]


@pytest.mark.subprocess
def test_no_compiler_falls_back_with_one_warning(tmp_path):
    """Without a compiler the reference path runs, with a one-line warning; insisting on
    native kernels is an error that says why."""
    code = (
        "import torch\n"
        "from tokenmill.model.ops import select_ops\n"
        "print(type(select_ops(torch.device('cpu'), 'auto')).__name__)\n"
        "try:\n    select_ops(torch.device('cpu'), 'native')\nexcept RuntimeError as e:\n    print('ERR', e)\n"
    )
    env = dict(os.environ, PATH=str(tmp_path), CXX="no-such-compiler")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "TorchOps"
    assert "ERR kernels='native'" in r.stdout
    warnings = [line for line in r.stderr.splitlines() if "native CPU kernels unavailable" in line]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0]


def test_select_ops_on_other_devices_is_the_reference():
    assert type(select_ops(torch.device("meta"), "auto")) is TorchOps
    assert type(select_ops(torch.device("cpu"), "torch")) is TorchOps
    with pytest.raises(ValueError, match="kernels must be"):
        select_ops(torch.device("cpu"), "fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9])
def test_small_linear_matches_torch(dtype, rows):
    """Decode-time linears (few rows): odd output counts (tiles of 4) and input widths that
    leave a masked tail (not a multiple of 16); more rows than the kernel takes go to torch."""
    from tokenmill.kernels.linear import NativeLinear

    g = torch.Generator().manual_seed(rows)
    for n, k in ((7, 100), (576, 576), (1539, 1536)):
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(rows, k, generator=g).to(dtype)
        ref = torch.nn.functional.linear(x.float(), w.float())
        out = NativeLinear(w)(x).float()
        tol = 1e-4 if dtype == torch.float32 else 2e-2 * ref.abs().max().item()
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=tol)


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_small_linear_float16_weights(rows):
    """float16 weights with float32 activations (F16C on AVX2, vcvtph2ps on AVX-512)."""
    g = torch.Generator().manual_seed(rows)
    for n, k in ((7, 100), (576, 576), (1539, 1536)):
        w = torch.randn(n, k, generator=g).half()
        x = torch.randn(rows, k, generator=g)
        out = torch.ops.tokenmill.small_linear(x, w, None)
        torch.testing.assert_close(out, x @ w.float().T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_small_linear_row_alone_is_the_same_bits_as_in_a_batch(wtype):
    """One activation row streams the weight rows one by one; more rows go through 4x4 tiles:
    each output is the same sum in the same order either way (a decode's logits do not depend
    on whether it was batched), the masked tail included (k not a multiple of 16); a bfloat16
    row is read as it is (widened exactly, in L1 where its float32 copy was not) to the same bits.
    A row alone through the tiles (one_stream=False, a machine's choice) gives the same bits too."""
    g = torch.Generator().manual_seed(3)
    for n, k in ((7, 100), (1539, 1536), (64, 576), (40, 8192)):
        w = torch.randn(n, k, generator=g)
        scale = None
        if wtype == torch.int8:
            scale = w.abs().amax(1) / 127
            w = (w / scale[:, None]).round().to(torch.int8)
        else:
            w = w.to(wtype)
        x = torch.randn(8, k, generator=g)
        for xt in (x, x.bfloat16()):
            batched = torch.ops.tokenmill.small_linear(xt, w, scale)
            for i in (0, 5, 7):
                for one_stream in (True, False):
                    alone = torch.ops.tokenmill.small_linear(xt[i : i + 1], w, scale, one_stream)
                    assert torch.equal(alone, batched[i : i + 1])


def test_big_bfloat16_batches_upcast_to_float32_gemm():
    """Prefill-sized bfloat16 batches (>= upcast_rows) multiply in float32 and round once:
    at least as close to the exact product as the bfloat16 GEMM, and below the threshold
    nothing changes."""
    from tokenmill.kernels.linear import NativeLinear

    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 576, generator=g).bfloat16()
    for rows in (127, 128, 200):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        exact = torch.nn.functional.linear(x.double(), w.double())
        out = NativeLinear(w, upcast_rows=128)(x)
        plain = torch.nn.functional.linear(x, w)
        if rows < 128:
            assert torch.equal(out, plain)
        else:
            assert out.dtype == torch.bfloat16
            assert (out.double() - exact).abs().max() <= (plain.double() - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float32_batches_past_the_small_kernel_run_on_the_gemm_tiles_batch_invariant(dtype):
    """Prefill-sized float32 batches (past the small-linear kernel) go to the own GEMM tiles
    (csrc/gemm.cpp) for float32, F16 and BF16 weights: the product to float32 rounding, with
    edge tiles on both sides (300 outputs: 18 panels of 16 and 12; rows not a multiple of 6;
    k neither a multiple of 8 nor of the 256-step panels), and every row's output the same bits
    whatever batch it came in. Float32 weights past TILE_ROWS go to PyTorch's GEMM."""
    from tokenmill.kernels.linear import TILE_ROWS, NativeLinear

    g = torch.Generator().manual_seed(5)
    for k in (576, 581, 1100):
        w = torch.randn(300, k, generator=g).to(dtype)
        layer = NativeLinear(w)
        for rows in (9, 40, TILE_ROWS + 1):
            x = torch.randn(rows, k, generator=g)
            exact = torch.nn.functional.linear(x.double(), w.double())
            out = layer(x)
            assert out.dtype == torch.float32 and out.shape == (rows, 300) and out.is_contiguous()
            torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-4)
        x = torch.randn(40, k, generator=g)
        assert torch.equal(layer(x)[17:], layer(x[17:].clone()))  # rows 17-39 alone, and in the batch of 40
        assert torch.equal(torch.ops.tokenmill.tile_gemm(x, w)[3], torch.ops.tokenmill.tile_gemm(x[3:4], w)[0])
        x = torch.randn(110, k, generator=g)  # 19 row tiles: blocks of x's rows (MT) and a partial one
        out = torch.ops.tokenmill.tile_gemm(x, w)
        torch.testing.assert_close(
            out.double(), torch.nn.functional.linear(x.double(), w.double()), rtol=1e-5, atol=1e-4
        )
        assert torch.equal(out[50:], torch.ops.tokenmill.tile_gemm(x[50:].clone(), w))


def test_float16_weights_under_bfloat16_batches_run_on_the_gemm_tiles_batch_invariant():
    """A GGUF's F16 weights kept 16-bit under a bfloat16 model: batches past the small-linear
    kernel multiply on the GEMM tiles (the activations widened exactly, the product rounded once
    to bfloat16), every row the same bits in any such batch."""
    from tokenmill.kernels.linear import NativeLinear

    g = torch.Generator().manual_seed(6)
    w = torch.randn(300, 581, generator=g).half()
    layer = NativeLinear(w)
    for rows in (9, 40, 300):
        x = torch.randn(rows, 581, generator=g).bfloat16()
        out = layer(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 300)
        assert torch.equal(out, torch.ops.tokenmill.tile_gemm(x.float(), w).bfloat16())
        exact = torch.nn.functional.linear(x.double(), w.double())
        torch.testing.assert_close(out.double(), exact, rtol=8e-3, atol=2e-2)
    x = torch.randn(40, 581, generator=g).bfloat16()
    assert torch.equal(layer(x)[17:], layer(x[17:].clone()))  # rows 17-39 alone, and in the batch of 40


@pytest.mark.parametrize("packed", [False, True])
def test_float16_weights_split_into_bfloat16_halves_multiply_the_float16_weight_itself(packed):
    """The two bfloat16 halves of a float16 weight add up to it exactly (subnormals and the range's
    ends included), and from the chosen row count a layer multiplies on them: the float16 weight's
    product (as close to the exact one as the float32 tiles' sums), rounded once to bfloat16; below
    that count the tiles' bits, unchanged."""
    from tokenmill.kernels.linear import NativeLinear, packing_available, split_float16

    if packed and not packing_available():
        pytest.skip("this torch has no oneDNN weight packing")
    g = torch.Generator().manual_seed(8)
    w = torch.randn(300, 581, generator=g).half()
    w[0, :6] = torch.tensor([65504.0, -65504.0, 6.1e-5, 5.96e-8, -3.0e-7, 0.0]).half()  # ends, subnormals
    halves = split_float16(w)
    assert halves.dtype == torch.bfloat16 and halves.shape == (300, 2 * 581)
    assert torch.equal(halves[:, :581].double() + halves[:, 581:].double(), w.double())
    layer = NativeLinear(w, split=split_float16(w, packed), split_rows=32)
    for rows in (9, 31, 32, 300):
        x = torch.randn(rows, 581, generator=g).bfloat16()
        out = layer(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 300)
        tiles = torch.ops.tokenmill.tile_gemm(x.float(), w)
        if rows < 32:
            assert torch.equal(out, tiles.bfloat16())
            continue
        exact = torch.nn.functional.linear(x.double(), w.double())
        # summed in float32 in another order than the tiles: as near the exact product as they are
        err, tiles_err = (out.double() - exact).abs().mean(), (tiles.bfloat16().double() - exact).abs().mean()
        assert err <= 1.05 * tiles_err, (err, tiles_err)
        torch.testing.assert_close(out.double(), exact, rtol=8e-3, atol=2e-2)


def test_float16_halves_are_kept_only_where_memory_allows_else_made_per_call(monkeypatch):
    from tests.helpers import tiny_model
    from tokenmill.kernels import linear as native_linear
    from tokenmill.kernels.linear import NativeLinear, split_linear, split_linear_slabs

    for free, kept in ((64 << 30, True), (1 << 10, False)):
        monkeypatch.setattr(native_linear, "available_memory", lambda free=free: free)
        model = tiny_model(3).half()
        native_linear.use_native_linears(model, None, f16_split_rows=(16, 24))
        layers = [m for m in model.modules() if isinstance(m, NativeLinear)]
        assert layers and all((m.split is not None) == kept for m in layers)
        assert all(m.split_rows == (16 if kept else 24) for m in layers)
        for m in layers:  # 20 rows: the kept halves' GEMM, or (below 24) the tiles; 30: the halves either way
            x = torch.randn(20, m.in_features).bfloat16()
            want = split_linear(x, m.split) if kept else torch.ops.tokenmill.tile_gemm(x.float(), m.weight)
            assert torch.equal(m(x), want.bfloat16())
            x = torch.randn(30, m.in_features).bfloat16()
            assert torch.equal(m(x), split_linear(x, m.split) if kept else split_linear_slabs(x, m.weight))


@pytest.mark.parametrize("n", [40, 3000])
def test_float16_halves_made_per_call_are_the_kept_halves_product(n, monkeypatch):
    """The one-pass C++ halves are split_float16's bit for bit, and the per-call product slab by slab
    (SLAB_BYTES made small: several slabs) multiplies the same float16 weight: within one bfloat16
    rounding of the kept halves' product, as near the exact product."""
    from tokenmill.kernels import linear as native_linear
    from tokenmill.kernels.linear import split_float16, split_linear, split_linear_slabs

    g = torch.Generator().manual_seed(9)
    w = torch.randn(n, 200, generator=g).half()
    w[0, :4] = torch.tensor([65504.0, 6.1e-5, 5.96e-8, -3.0e-7]).half()
    assert torch.equal(torch.ops.tokenmill.float16_halves(w).view(torch.int16), split_float16(w).view(torch.int16))
    monkeypatch.setattr(native_linear, "SLAB_BYTES", 64 * 1024)
    x = torch.randn(33, 200, generator=g).bfloat16()
    exact = torch.nn.functional.linear(x.double(), w.double())
    slabs, kept = split_linear_slabs(x, w), split_linear(x, split_float16(w))
    torch.testing.assert_close(slabs.double(), exact, rtol=8e-3, atol=2e-2)
    assert (slabs.double() - exact).abs().mean() <= 1.05 * (kept.double() - exact).abs().mean()


def test_gemm_tiles_are_as_close_to_the_exact_product_as_torchs_gemm():
    """Long sums (k = 2048: 8 panels of 256) are not one FMA chain: each panel's chain from zero,
    the panels added, so the error stays at PyTorch's (MKL's) own level, not ~3x it."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(64, 2048, generator=g), torch.randn(512, 2048, generator=g)
    exact = x.double() @ w.double().T
    ours = (torch.ops.tokenmill.tile_gemm(x, w).double() - exact).abs().mean()
    theirs = (torch.nn.functional.linear(x, w).double() - exact).abs().mean()
    assert ours <= 1.5 * theirs, (ours, theirs)


def test_16_bit_weights_upcast_slab_by_slab_as_one_product(monkeypatch):
    """16-bit weights multiplied in float32 through PyTorch's GEMM (where the tiles do not
    run: a bfloat16 model's big batches, a build without them): the weight is upcast a slab at
    a time (kernels/linear.py SLAB_BYTES), and the product is the whole float32 one's to float32
    rounding: slabs that split the rows unevenly, one slab, and a bfloat16 weight under
    bfloat16 compute upcast for a big batch."""
    from tokenmill.kernels import linear as native_linear

    g = torch.Generator().manual_seed(5)
    for slab_bytes in (4 * 576 * 8, 4 * 576 * 64, 1 << 23):  # 37 slabs (the last one short), 5, one
        monkeypatch.setattr(native_linear, "SLAB_BYTES", slab_bytes)
        for dtype in (torch.float16, torch.bfloat16):
            w = torch.randn(300, 576, generator=g).to(dtype)
            x = torch.randn(40, 576, generator=g)
            ref = torch.nn.functional.linear(x, w.float())
            out = native_linear.upcast_linear(x, w)
            assert out.dtype == torch.float32 and out.shape == (40, 300) and out.is_contiguous()
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
        wb = torch.randn(300, 576, generator=g).bfloat16()
        xb = torch.randn(200, 576, generator=g).bfloat16()
        out = native_linear.NativeLinear(wb, upcast_rows=128)(xb)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(
            out, torch.nn.functional.linear(xb.float(), wb.float()).bfloat16(), rtol=1e-2, atol=1e-2
        )


@pytest.mark.parametrize("rows", [1, 4, 6])
def test_int8_small_linear_matches_the_int8_reference(rows):
    from tokenmill.quant.weights import Int8Linear

    g = torch.Generator().manual_seed(7)
    layer = Int8Linear.quantize(torch.randn(579, 576, generator=g), torch.bfloat16)
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    ref = layer(x).float()
    layer.enable_small_batch_kernel(4)
    out = layer(x).float()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_bfloat16_native_model_stays_close_to_float32():
    """bfloat16 with every native kernel (linears included) agrees with float32 on the
    next token of real prompts: the bfloat16 path is approximate, not wrong."""
    from tokenmill import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The largest planet is"]
    params = SamplingParams(temperature=0, max_tokens=1)
    first = []
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, kernels="native", progress=False, kv_cache_memory="64MiB")
        first.append([o.outputs[0].token_ids[0] for o in llm.generate(prompts, params)])
    assert first[0] == first[1]


@pytest.mark.subprocess
def test_avx2_only_build_matches_the_reference():
    """The portable (AVX2, no AVX-512) build of the kernels, compiled here with
    -march=haswell, passes the same attention, norm and linear checks: what an
    AVX2-only machine runs."""
    run_on_avx2_build(
        "import tests.model.test_native_kernels as t\n"
        "t.check_attention(t.DECODES + [(700, 4), (90, 90), (2600, 300)], heads=9, kv_heads=3)\n"
        "t.test_sliding_windows_and_soft_capping(64, 30.0)\n"
        "t.test_attention_of_a_query_does_not_depend_on_its_step(9, 3, 64)\n"
        "t.test_attention_of_a_query_does_not_depend_on_its_step(8, 2, 128)\n"
        "t.test_a_query_head_has_the_same_bits_whatever_its_kv_head_shares(3)\n"
        "t.test_a_query_head_has_the_same_bits_whatever_its_kv_head_shares(7)\n"
        "t.test_long_prefill_chunk_over_a_long_context()\n"
        "t.BS = 8\n"
        "t.check_attention([(15, 1), (300, 1), (47, 5), (33, 33)], heads=9, kv_heads=3, window=20)\n"
        "t.BS = 16\n"
        "t.check_attention(t.DECODES, kind='int8')\n"
        "t.check_attention(t.DECODES + [(50, 3)], heads=9, kv_heads=3, kind='fp8', dtype=torch.bfloat16)\n"
        "t.test_rms_norm_and_fused_residual_add(torch.bfloat16)\n"
        "for rows in (1, 3, 8):\n"
        "    t.test_small_linear_matches_torch(torch.bfloat16, rows)\n"
        "    t.test_small_linear_matches_torch(torch.float32, rows)\n"
        "t.test_int8_small_linear_matches_the_int8_reference(1)\n"
        "t.test_small_linear_float16_weights(3)\n"
        "for wtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8):\n"
        "    t.test_small_linear_row_alone_is_the_same_bits_as_in_a_batch(wtype)\n"
        "for dtype in (torch.float32, torch.float16):\n"
        "    t.test_float32_batches_past_the_small_kernel_run_on_the_gemm_tiles_batch_invariant(dtype)\n"
        "t.test_cpp_layer_loop_is_bit_identical_to_the_python_loop('float32', 'auto')\n"
        "from tokenmill.kernels.linear import split_float16\n"
        "w = torch.randn(40, 203).half()\n"
        "assert torch.equal(torch.ops.tokenmill.float16_halves(w).view(torch.int16), split_float16(w).view(torch.int16))\n"
    )


@pytest.mark.parametrize(
    "dtype,quantization", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "none"), ("bfloat16", "none")]
)
def test_cpp_layer_loop_is_bit_identical_to_the_python_loop(dtype, quantization):
    """Decode steps of the plain Llama layer run in C++ (decode_layers): the same kernels in
    the same order as the Python loop, so the logits are equal to the bit, for one sequence
    and for three decoding together, from packed and from float weights (bfloat16 ones on the
    bfloat16 dot products where the CPU has them)."""
    from tests.helpers import fused_and_python_decode_logits
    from tokenmill import LLM

    llm = LLM(dtype=dtype, quantization=quantization, progress=False, kv_cache_memory="32MiB")
    assert llm.parts.model.fused_plan is not None
    results = fused_and_python_decode_logits(llm)
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])


@pytest.mark.parametrize("dtype,one_stream", [("float32", True), ("float32", False), ("bfloat16", False)])
def test_cpp_layer_loop_runs_float16_weights_in_one_team_bit_identical_to_the_python_loop(dtype, one_stream):
    """A float16 file's decode (float16 weights, float32 or bfloat16 activations) runs its layers in
    the C++ loop's one team of threads: each linear's rows split between the threads on
    small_linear's kernel, single stream or tiles at one row as the machine chose. The logits equal
    the Python loop's to the bit."""
    from tests.helpers import fused_and_python_decode_logits
    from tokenmill import LLM
    from tokenmill.kernels.linear import NativeLinear

    llm = LLM(dtype=dtype, quantization="none", progress=False, kv_cache_memory="32MiB")
    model = llm.parts.model
    linears = [m for layer in model.layers for m in layer.modules() if isinstance(m, NativeLinear)]
    assert len(linears) == 4 * len(model.layers)
    for m in linears:
        m.weight = torch.nn.Parameter(m.weight.detach().half(), requires_grad=False)
        m.one_stream = one_stream
    model.reset_fused_plan()
    plan = model.fused_plan
    assert plan is not None and plan.kinds[:8] == [0, 0 if one_stream else 1] * 4
    results = fused_and_python_decode_logits(llm)
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])


def test_layers_the_loop_does_not_serve_take_the_python_path():
    """A model whose layers are not the plain Llama layer (here: q/k/v biases) has no plan."""
    from tests.helpers import tiny_model
    from tokenmill.kernels.linear import NativeLinear, use_native_linears

    model = tiny_model(0)
    model.ops = NativeOps()
    use_native_linears(model)
    assert model.fused_plan is not None
    model.layers[0].self_attn.qkv_proj = NativeLinear(model.layers[0].self_attn.qkv_proj.weight, bias=torch.zeros(64))
    model.reset_fused_plan()
    assert model.fused_plan is None


def test_native_linears_follow_the_one_row_choice_into_the_c_layer_loop():
    from tests.helpers import tiny_model
    from tokenmill.kernels import linear as native_linear
    from tokenmill.kernels.linear import NativeLinear

    model = tiny_model(3).bfloat16()
    native_linear.use_native_linears(model, None, one_stream=False)
    layers = [m for m in model.modules() if isinstance(m, NativeLinear)]
    assert layers and not any(m.one_stream for m in layers)
    plan = model.fused_plan
    assert plan is not None and plan.kinds[:8] == [0, 1] * 4  # float weights, tiles at one row
    x = torch.randn(1, layers[0].in_features).bfloat16()
    assert torch.equal(layers[0](x), torch.ops.tokenmill.small_linear(x, layers[0].weight, None, True))
