"""The model families registry: every family is found by each of its names, and an
unknown one is refused with the list of those supported."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.errors import ModelLoadError
from tokenmill.model.families import FAMILIES, GGUF_FAMILIES, HF_FAMILIES, family_named, gguf_family, hf_family


def test_each_family_is_found_by_each_of_its_names():
    for f in FAMILIES:
        for t in f.hf_model_types:
            assert hf_family(t, Path("m")) is f and family_named(t) is f
        for a in f.gguf_archs:
            assert gguf_family(a, Path("m.gguf")) is f and family_named(a) is f
    assert len(HF_FAMILIES) == sum(len(f.hf_model_types) for f in FAMILIES)  # no name claimed twice
    assert len(GGUF_FAMILIES) == sum(len(f.gguf_archs) for f in FAMILIES)


def test_unknown_architectures_are_refused_with_what_is_supported():
    with pytest.raises(ModelLoadError, match=r"unsupported model_type 'gpt_neox'.*gemma2.*qwen3"):
        hf_family("gpt_neox", Path("m"))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'falcon'.*llama"):
        gguf_family("falcon", Path("m.gguf"))


def test_gemma_gguf_defaults_follow_llama_cpp():
    """Local layers every other one (Gemma 2) / five in six (Gemma 3), llama.cpp's
    defaults where the file does not say; the 27B models' query scale."""

    def key_of(values):
        return lambda name, default=None: values.get(name, default)

    g2 = gguf_family("gemma2", Path("g"))
    f = g2.gguf_fields("gemma2", key_of({"block_count": 4, "attention.sliding_window": 4096}), 2304, 8, 8192)
    assert f["layer_windows"] == (4096, None, 4096, None) and f["query_scale"] == (2304 // 8) ** -0.5
    g3 = gguf_family("gemma3", Path("g"))
    f = g3.gguf_fields("gemma3", key_of({"block_count": 62, "attention.sliding_window": 1024}), 5376, 32, 131072)
    assert f["layer_windows"][:6] == (1024,) * 5 + (None,) and f["query_scale"] == (5376 / 32) ** -0.5
    assert f["rope_local_theta"] == 10000.0
