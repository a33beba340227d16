"""The bfloat16 GEMM choice (kernels/gemm_choice.py): measured once per machine and kept,
an override honoured, and the choice followed by NativeLinear without changing what
either path computes (the upcast rounds once; the packed weight is the plain GEMM bit for bit)."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill.kernels import gemm_choice
from tokenmill.kernels import linear as native_linear
from tokenmill.kernels.linear import NativeLinear, pack, packed_linear, upcast_linear


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TOKENMILL_UPCAST_ROWS", raising=False)
    monkeypatch.delenv("TOKENMILL_PREPACK", raising=False)
    monkeypatch.delenv("TOKENMILL_BLOCK_GEMM_ROWS", raising=False)
    return tmp_path


def test_the_probe_runs_once_per_machine_and_its_answer_is_kept(cache_home, monkeypatch):
    calls = []

    def fake_probe() -> dict:  # the timing itself is the machine's: here only the bookkeeping is tested
        calls.append(1)
        return {"upcast_rows": 256, "prepacked": False, "ms": {}, "measured": "now"}

    monkeypatch.setattr(gemm_choice, "probe", fake_probe)
    assert gemm_choice.upcast_rows() == 256
    assert gemm_choice.upcast_rows() == 256
    assert len(calls) == 1
    kept = json.loads((cache_home / "tokenmill" / "gemm_choice.json").read_text())
    assert kept[gemm_choice.machine_key()]["upcast_rows"] == 256
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)  # another thread count is another machine
    assert gemm_choice.upcast_rows() == 256
    assert len(calls) == 2


def test_a_broken_cache_file_is_measured_again_not_an_error(cache_home, monkeypatch):
    (cache_home / "tokenmill").mkdir()
    (cache_home / "tokenmill" / "gemm_choice.json").write_text("{not json")
    monkeypatch.setattr(
        gemm_choice, "probe", lambda: {"upcast_rows": None, "prepacked": True, "ms": {}, "measured": "now"}
    )
    assert gemm_choice.upcast_rows() is None
    assert json.loads((cache_home / "tokenmill" / "gemm_choice.json").read_text())


def test_the_override_wins_over_the_probe(cache_home, monkeypatch):
    monkeypatch.setattr(gemm_choice, "probe", lambda: pytest.fail("probed despite the override"))
    monkeypatch.setenv("TOKENMILL_UPCAST_ROWS", "never")
    assert gemm_choice.upcast_rows() is None
    monkeypatch.setenv("TOKENMILL_UPCAST_ROWS", "64")
    assert gemm_choice.upcast_rows() == 64


def test_the_probe_picks_the_smallest_batch_from_which_the_upcast_always_wins(monkeypatch):
    """Timings stood in for the GEMMs: the rule reads them as documented."""
    # (plain bfloat16, upcast, packed) ms at each probed batch
    table = {
        32: (1.0, 1.0, 0.5),
        64: (2.0, 1.7, 1.0),
        128: (4.0, 4.1, 3.0),
        256: (8.0, 6.0, 9.0),
        512: (16.0, 10.0, 20.0),
    }
    seen = iter(table[rows] for rows in gemm_choice.PROBE_ROWS)
    monkeypatch.setattr(gemm_choice, "best_ms_each", lambda calls: list(next(seen))[: len(calls)])
    monkeypatch.setattr(gemm_choice, "packing_available", lambda: True)  # as on a CPU oneDNN packs for
    monkeypatch.setattr(gemm_choice, "pack", lambda weight: weight)
    answer = gemm_choice.probe()
    assert answer["upcast_rows"] == 256  # 64 wins, but 128 does not: from 256 on
    assert answer["prepacked"]  # judged below the upcast only: 0.5, 0.5, 0.75 of the plain GEMM's time
    seen = iter((1.0, 2.0, 0.98) for rows in gemm_choice.PROBE_ROWS)
    monkeypatch.setattr(gemm_choice, "best_ms_each", lambda calls: list(next(seen))[: len(calls)])
    answer = gemm_choice.probe()
    assert answer["upcast_rows"] is None
    assert not answer["prepacked"]  # 2% faster is within the noise: not worth a second copy


def test_the_probe_runs_where_onednn_packs_no_bfloat16_weight(monkeypatch):
    """An AVX2-only CPU (no AVX-512, no AVX-NE-CONVERT): oneDNN refuses to pack a bfloat16 weight,
    so packing is unavailable there and the probe, the first bfloat16 load's, measures the two
    GEMMs without it (it raised before, and no bfloat16 model loaded on such a CPU)."""

    def refuse(weight):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw")

    monkeypatch.setattr(native_linear, "pack", refuse)
    native_linear.packing_available.cache_clear()
    try:
        assert not native_linear.packing_available()
        monkeypatch.setattr(gemm_choice, "packing_available", native_linear.packing_available)
        monkeypatch.setattr(gemm_choice, "pack", refuse)
        monkeypatch.setattr(gemm_choice, "best_ms_each", lambda calls: [1.0] * len(calls))
        answer = gemm_choice.probe()
        assert answer["prepacked"] is False
        assert all(set(ms) == {"bfloat16", "float32"} for ms in answer["ms"].values())
    finally:
        native_linear.packing_available.cache_clear()


def test_native_linear_follows_the_choice_and_each_path_computes_what_it_did():
    """Past the chosen row count the layer multiplies in float32 (upcast_linear, rounded
    once); with no upcast it is PyTorch's bfloat16 GEMM, bit for bit, at every size."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 64, generator=g).bfloat16()
    for rows in (16, 200):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        assert torch.equal(NativeLinear(w, upcast_rows=None)(x), torch.nn.functional.linear(x, w))
        upcast = NativeLinear(w, upcast_rows=100)(x)
        if rows >= 100:
            assert torch.equal(upcast, upcast_linear(x, w).bfloat16())
        else:
            assert torch.equal(upcast, torch.nn.functional.linear(x, w))


@pytest.mark.skipif(not native_linear.packing_available(), reason="oneDNN packs no bfloat16 weight on this CPU")
def test_the_packed_weight_is_the_plain_gemm_bit_for_bit_at_every_batch():
    """What makes packing an optimisation that changes no output: oneDNN's GEMM on its own
    layout gives the plain bfloat16 GEMM's results exactly, row by row, whatever the batch."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(1536, 576, generator=g).bfloat16()
    layer = NativeLinear(w, packed=pack(w))
    for rows in (9, 16, 33, 64, 200, 513):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        assert torch.equal(layer(x), torch.nn.functional.linear(x, w))
        assert torch.equal(packed_linear(x, layer.packed), torch.nn.functional.linear(x, w))


def test_weights_are_packed_only_where_memory_allows(monkeypatch):
    """A packed copy doubles a weight's memory: past PACKED_MEMORY_SHARE of what is free, the
    model keeps the plain GEMM (and still computes the same); so does a CPU oneDNN packs no
    bfloat16 weight on (AVX2 only)."""
    from tests.helpers import tiny_model

    for free, expect_packed in ((64 << 30, native_linear.packing_available()), (1 << 10, False)):
        monkeypatch.setattr(native_linear, "available_memory", lambda free=free: free)
        model = tiny_model(3).bfloat16()
        native_linear.use_native_linears(model, None, prepack=True)
        layers = [m for m in model.modules() if isinstance(m, NativeLinear)]
        assert len(layers) == 2 * 4 + 1  # qkv, o, gate_up, down a layer, and the head
        assert all((m.packed is not None) == expect_packed for m in layers)
        for m in layers:  # 20 rows: past the small-batch kernel, the packed (or plain) GEMM
            x = torch.randn(20, m.in_features).bfloat16()
            assert torch.equal(m(x), torch.nn.functional.linear(x, m.weight))


def test_each_block_type_is_probed_once_and_kept_beside_the_gemm_answers(cache_home, monkeypatch):
    probed = []
    monkeypatch.setattr(gemm_choice, "probe", lambda: {"upcast_rows": None, "prepacked": True, "ms": {}})

    def fake_probe_blocks(type_name: str) -> dict:
        probed.append(type_name)
        return {"gemm_rows": 512 if type_name == "Q6_K" else None, "ms": {}}

    monkeypatch.setattr(gemm_choice, "probe_blocks", fake_probe_blocks)
    assert gemm_choice.block_gemm_rows("Q6_K") == 512
    assert gemm_choice.block_gemm_rows("Q4_K") is None
    assert gemm_choice.block_gemm_rows("Q6_K") == 512 and gemm_choice.block_gemm_rows("Q4_K") is None
    assert probed == ["Q6_K", "Q4_K"]
    kept = json.loads((cache_home / "tokenmill" / "gemm_choice.json").read_text())[gemm_choice.machine_key()]
    assert kept["blocks"]["Q6_K"]["gemm_rows"] == 512 and kept["prepacked"]  # the earlier answers kept too
    monkeypatch.setattr(gemm_choice, "build_name", lambda: "another build")  # new kernels: measured again
    assert gemm_choice.block_gemm_rows("Q6_K") == 512 and probed == ["Q6_K", "Q4_K", "Q6_K"]
    monkeypatch.setenv("TOKENMILL_BLOCK_GEMM_ROWS", "never")
    assert gemm_choice.block_gemm_rows("Q6_K") is None
    monkeypatch.setenv("TOKENMILL_BLOCK_GEMM_ROWS", "48")
    assert gemm_choice.block_gemm_rows("Q8_0") == 48 and probed == ["Q6_K", "Q4_K", "Q6_K"]


def test_the_block_probe_picks_the_smallest_batch_from_which_the_gemm_always_wins(monkeypatch):
    """(integer dots, dequantised GEMM) ms stood in at each probed batch."""
    monkeypatch.setattr(torch.ops.tokenmill, "block_linear", lambda *a: None, raising=False)
    monkeypatch.setattr(torch.ops.tokenmill, "block_has_groups", lambda code: False, raising=False)
    for table, want in (
        ({64: (1.0, 3.0), 128: (2.0, 1.5), 256: (4.0, 4.0), 512: (8.0, 6.0)}, 512),  # 128 wins, 256 does not
        ({64: (1.0, 0.5), 128: (2.0, 1.0), 256: (4.0, 2.0), 512: (8.0, 4.0)}, 64),
        ({64: (1.0, 3.0), 128: (2.0, 3.0), 256: (4.0, 5.0), 512: (8.0, 7.5)}, None),  # 6% is not a win
    ):
        seen = iter(table[rows] for rows in gemm_choice.BLOCK_PROBE_ROWS)
        monkeypatch.setattr(gemm_choice, "best_ms_each", lambda calls, seen=seen: list(next(seen)))
        assert gemm_choice.probe_blocks("Q4_K")["gemm_rows"] == want


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_the_probe_blocks_hold_finite_weights(type_name):
    from tokenmill.quant.blocks import BlockWeight

    k = 512
    w = BlockWeight(gemm_choice.random_blocks(type_name, 8, k), type_name, k)
    assert torch.isfinite(w.dequantize()).all()


def test_the_float16_split_is_probed_once_kept_and_overridden(cache_home, monkeypatch):
    probed = []
    monkeypatch.setattr(gemm_choice, "probe", lambda: {"upcast_rows": None, "prepacked": True, "ms": {}})
    answer = {"rows": 64, "per_call_rows": 128, "ms": {}}
    monkeypatch.setattr(gemm_choice, "probe_f16_split", lambda packed: probed.append(packed) or answer)
    monkeypatch.delenv("TOKENMILL_F16_SPLIT_ROWS", raising=False)
    assert gemm_choice.f16_split_rows() == (64, 128) and gemm_choice.f16_split_rows() == (64, 128)
    assert len(probed) == 1
    kept = json.loads((cache_home / "tokenmill" / "gemm_choice.json").read_text())[gemm_choice.machine_key()]
    assert kept["f16_split"]["float16 x bfloat16"]["rows"] == 64 and kept["prepacked"]  # the earlier answers kept too
    monkeypatch.setattr(gemm_choice, "build_name", lambda: "another build")  # new kernels: measured again
    assert gemm_choice.f16_split_rows() == (64, 128) and len(probed) == 2
    monkeypatch.setenv("TOKENMILL_F16_SPLIT_ROWS", "never")
    assert gemm_choice.f16_split_rows() == (None, None)
    monkeypatch.setenv("TOKENMILL_F16_SPLIT_ROWS", "48")
    assert gemm_choice.f16_split_rows() == (48, 48) and len(probed) == 2


def test_the_float16_split_probe_picks_the_smallest_batch_from_which_the_halves_always_win(monkeypatch):
    """(float32 tiles, halves kept, halves made per call) ms stood in at each probed batch; each
    way of the halves judged against the tiles."""
    for table, kept, per_call in (
        ({32: (1, 1.2, 3), 64: (2, 1.5, 3), 128: (4, 4, 3), 256: (8, 6, 5), 512: (16, 9, 10)}, 256, 128),
        ({32: (1, 0.5, 1), 64: (2, 1, 1.5), 128: (4, 2, 3), 256: (8, 4, 5), 512: (16, 8, 9)}, 32, 64),
        ({32: (1, 3, 3), 64: (2, 3, 3), 128: (4, 5, 5), 256: (8, 7.7, 8), 512: (16, 15.5, 16)}, None, None),
    ):
        seen = iter(table[rows] for rows in gemm_choice.PROBE_ROWS)
        monkeypatch.setattr(gemm_choice, "best_ms_each", lambda calls, seen=seen: list(next(seen)))
        answer = gemm_choice.probe_f16_split(False)
        assert (answer["rows"], answer["per_call_rows"]) == (kept, per_call)


def test_the_one_row_choice_is_probed_per_dtype_kept_and_overridden(cache_home, monkeypatch):
    probed = []
    monkeypatch.setattr(gemm_choice, "probe", lambda: {"upcast_rows": None, "prepacked": True, "ms": {}})

    def fake(weight, act):
        probed.append((weight, act))
        return {"one_stream": weight == torch.float32, "ms": {}}

    monkeypatch.setattr(gemm_choice, "probe_one_row", fake)
    monkeypatch.delenv("TOKENMILL_ONE_ROW", raising=False)
    assert not gemm_choice.one_row_stream(torch.bfloat16, torch.bfloat16)
    assert gemm_choice.one_row_stream(torch.float32, torch.float32)
    assert not gemm_choice.one_row_stream(torch.bfloat16, torch.bfloat16) and len(probed) == 2
    kept = json.loads((cache_home / "tokenmill" / "gemm_choice.json").read_text())[gemm_choice.machine_key()]
    assert kept["one_row"]["bfloat16 x bfloat16, decoder shapes"]["one_stream"] is False and kept["prepacked"]
    monkeypatch.setattr(gemm_choice, "build_name", lambda: "another build")  # new kernels: measured again
    assert not gemm_choice.one_row_stream(torch.bfloat16, torch.bfloat16) and len(probed) == 3
    monkeypatch.setenv("TOKENMILL_ONE_ROW", "stream")
    assert gemm_choice.one_row_stream(torch.bfloat16, torch.bfloat16) and len(probed) == 3


def test_the_one_row_probe_keeps_the_faster_way(monkeypatch):
    """(one stream, tiles) ms stood in; the probe's matrices made small so that it runs here."""
    monkeypatch.setattr(gemm_choice, "ONE_ROW_PROBE_BYTES", 3 << 20)
    calls = []
    monkeypatch.setattr(
        torch.ops.tokenmill, "small_linear", lambda x, w, *a: calls.append((x.shape, w.shape)), raising=False
    )
    for timings, want in (((10.0, 8.0), False), ((10.0, 9.5), False), ((10.0, 10.0), True), ((10.0, 12.0), True)):
        monkeypatch.setattr(gemm_choice, "best_ms_each", lambda calls, t=timings: [c() for c in calls] and list(t))
        assert gemm_choice.probe_one_row(torch.bfloat16, torch.bfloat16)["one_stream"] is want
    # a decoder layer's projections, each read with an activation row of its own width
    assert {w for _, w in calls} == {(2048, 2048), (8192, 2048), (2048, 8192)}
    assert all(x == (1, w[1]) for x, w in calls)
