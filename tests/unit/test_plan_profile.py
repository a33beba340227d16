"""`tokenmill plan`'s calibrated step model: the fit recovers the costs a probe's points were
made from, a profile survives its JSON round trip and refuses another configuration, and a
load's prediction follows Little's law below capacity and capacity's rate above it. No
timing here: the probe's points are written by the test (the engine's are measured in
bench/RESULTS.md)."""

from __future__ import annotations

import math

import pytest

from tokenmill.plan.step_model import (
    DecodePoint,
    PrefillPoint,
    Profile,
    StepModel,
    default_profile_path,
    fit_nonnegative,
    least_squares,
    predict_load,
)

pytestmark = pytest.mark.unit

TRUE = StepModel(a=0.012, b=0.0015, c=2e-7, pa=0.010, p=2e-4, q=4e-8, busy_watts=6.0, busy_cpus=2.0)
FP = {"model": "m.gguf", "dtype": "float32", "weights": "auto", "kv_cache_dtype": "auto", "threads": 2}


def points(m: StepModel, noise=lambda i: 1.0):
    decode = [
        DecodePoint(b, b * (ctx + 5), m.decode_step(b, ctx + 5) * noise(i))
        for i, (b, ctx) in enumerate((b, ctx) for ctx in (128, 1024) for b in (1, 2, 4, 8, 16))
    ]
    chunks = [(32, 0), (128, 0), (384, 0), (512, 0), (512, 512)]  # 1024 tokens at a budget of 512: two chunks
    prefill = [PrefillPoint(n, s, m.prefill_step(n, s) * noise(i)) for i, (n, s) in enumerate(chunks)]
    return decode, prefill


def test_the_fit_recovers_the_costs_the_points_were_made_from():
    decode, prefill = points(TRUE)
    prof = Profile.from_points(decode, prefill, FP, busy_watts=6.0, busy_cpus=2.0, energy_source="estimated")
    m = prof.model
    for name in ("a", "b", "c", "pa", "p", "q"):
        assert getattr(m, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert prof.fit_errors() == pytest.approx((0.0, 0.0), abs=1e-9)
    # noisy points (+-3%): close, and the error says how close
    noisy = Profile.from_points(*points(TRUE, lambda i: 1.03 if i % 2 else 0.97), FP, 6.0, 2.0, "estimated")
    assert noisy.model.decode_tok_s(16, 600) == pytest.approx(TRUE.decode_tok_s(16, 600), rel=0.05)
    assert 0.02 < noisy.fit_errors()[0] < 0.04


def test_least_squares_weighs_each_point_by_its_share():
    # y = 1 + 2x exactly on three points, and one more it cannot fit: relative weighting
    # lets the big point's error be big in absolute terms, not the small points'
    rows, ys = [[1, 0], [1, 1], [1, 2], [1, 100]], [1.0, 3.0, 5.0, 250.0]
    a, b = least_squares(rows, ys)
    assert abs(a + b * 1 - 3) / 3 < 0.1 and abs(a + 100 * b - 250) / 250 < 0.3
    with pytest.raises(ValueError, match="cannot fit"):
        least_squares([[1, 2]], [1.0])
    with pytest.raises(ValueError, match="do not determine"):
        least_squares([[1, 1], [1, 1], [1, 1]], [1.0, 2.0, 3.0])


def test_a_cost_that_fits_negative_is_dropped_and_the_rest_refitted():
    # step time falling with the KV held (noise): c would come out < 0; it is 0 and a, b refit
    rows = [[1, b, kv] for b, kv in ((1, 100), (4, 400), (16, 1600), (1, 1000), (4, 4000), (16, 16000))]
    ys = [0.0115, 0.016, 0.034, 0.0112, 0.0157, 0.0335]
    a, b, c = fit_nonnegative(rows, ys)
    assert c == 0.0 and a > 0 and b > 0
    assert a + 16 * b == pytest.approx(0.034, rel=0.05)


def test_a_profile_survives_its_json_round_trip_and_refuses_another_configuration(tmp_path):
    prof = Profile.from_points(*points(TRUE), FP, 6.0, 2.0, "estimated", probe_seconds=4.2)
    path = tmp_path / "sub" / "profile.json"
    prof.save(path)
    back = Profile.load(path)
    assert back == prof
    assert back.mismatch(FP) == []
    assert back.mismatch({**FP, "weights": "int8"}) == ["weights: profile 'auto', now 'int8'"]
    data = prof.to_json()
    data["version"] = 0
    with pytest.raises(ValueError, match="calibrate again"):
        Profile.from_json(data)


def test_the_default_path_differs_by_configuration(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a = default_profile_path(FP)
    b = default_profile_path({**FP, "kv_cache_dtype": "int8"})
    assert a != b and a.parent == tmp_path / "tokenmill" / "profiles" and a.suffix == ".json"
    assert "/" not in a.name.removesuffix(".json")


def test_below_capacity_the_load_is_served_and_littles_law_holds():
    m = StepModel(a=0.010, b=0.002, c=0.0, pa=0.010, p=1e-4, q=0.0, busy_watts=6.0, busy_cpus=2.0)
    r, i, o = 2.0, 200, 100
    got = predict_load(m, r, i, o, max_seqs=64, price_per_hour=0.36)
    assert got.stable and got.output_tok_s == pytest.approx(r * o)
    free = 1 - r * 200 * 1e-4  # 4% of each second computes prompts
    assert got.tpot == pytest.approx(m.decode_step(got.concurrency, 0) / free, rel=1e-6)
    assert got.concurrency == pytest.approx(r * o * got.tpot, rel=1e-6)  # N = rate x O x tpot
    # N solves N = 200 (0.010 + 0.002 N) / 0.96 exactly: N = 2 / (0.96 - 0.4)
    assert got.concurrency == pytest.approx(2 / 0.56, rel=1e-6)
    steps = r * o / got.concurrency
    assert got.busy == pytest.approx(r * 0.02 + steps * m.decode_step(got.concurrency, 0))
    assert got.joules_per_token == pytest.approx(6.0 * got.busy / got.output_tok_s)
    assert got.dollars_per_million == pytest.approx(0.36 / 3600 / 200 * 1e6)
    # a watts figure of the user's replaces the profile's
    assert predict_load(m, r, i, o, 64, watts=3.0).joules_per_token == pytest.approx(got.joules_per_token / 2)


def test_a_light_load_decodes_in_batches_of_one():
    m = StepModel(a=0.010, b=0.002, c=0.0, pa=0.010, p=0.0, q=0.0, busy_watts=6.0, busy_cpus=2.0)
    got = predict_load(m, 0.1, 10, 50, max_seqs=64)
    assert got.tpot == pytest.approx(0.012) and got.busy == pytest.approx(5 * 0.012)


def test_above_capacity_the_output_is_capacitys():
    m = StepModel(a=0.010, b=0.002, c=1e-6, pa=0.010, p=1e-4, q=0.0, busy_watts=6.0, busy_cpus=2.0)
    i, o, seqs = 100, 50, 8
    cap = 1 / (100e-4 + o * m.decode_step(seqs, i + o / 2) / seqs)
    for rate in (cap * 1.5, math.inf):
        got = predict_load(m, rate, i, o, seqs)
        assert not got.stable and got.capacity_rate == pytest.approx(cap)
        assert got.output_tok_s == pytest.approx(cap * o) and got.busy == 1.0 and got.concurrency == seqs
    just_below = predict_load(m, cap * 0.999, i, o, seqs)
    assert just_below.stable and just_below.concurrency <= seqs
