"""Adapter folders a hostile client points the server at (issue 24, items 4, 6, 7, 8):
each is a LoRAError that names the problem (the server's 400), never another
exception (a 500), and nothing is read whole before its size is checked."""

from __future__ import annotations

import json
import math
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from tokenmill.config import ModelConfig
from tokenmill.lora.adapter import MAX_CONFIG_BYTES, MAX_HEADER_BYTES, LoRAError, load_adapter

CFG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip


def adapter(path, conf=None, a=None, b=None):
    """A one-projection adapter folder (q_proj of layer 0, rank 2)."""
    path.mkdir(parents=True, exist_ok=True)
    a = torch.randn(2, 16) if a is None else a
    b = torch.randn(16, 2) if b is None else b
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b}, str(path / "adapter_model.safetensors"))  # fmt: skip
    conf = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]} if conf is None else conf
    (path / "adapter_config.json").write_text(conf if isinstance(conf, str) else json.dumps(conf))
    return path


def refused(path, match):
    with pytest.raises(LoRAError, match=match):
        load_adapter("x", path, CFG, max_rank=8)


def test_a_good_adapter_loads(tmp_path):
    a = load_adapter("x", adapter(tmp_path / "a"), CFG, max_rank=8)
    assert a.rank == 2 and a.scaling == 2.0 and a.targets == {"q_proj"}


@pytest.mark.parametrize(("conf", "match"), [
    ({"peft_type": "LORA", "r": 2, "lora_alpha": None}, "lora_alpha must be a finite number"),
    ({"peft_type": "LORA", "r": 2, "lora_alpha": "8"}, "lora_alpha must be a finite number"),
    ('{"peft_type": "LORA", "r": 2, "lora_alpha": NaN}', "lora_alpha must be a finite number"),
    ('{"peft_type": "LORA", "r": 2, "lora_alpha": Infinity}', "lora_alpha must be a finite number"),
    ([{"r": 2}], "must hold a JSON object"),
    ("[" * 200_000 + "]" * 200_000, "not valid JSON"),
    ({"peft_type": "LORA", "r": "SECRET_TOKEN_abc123"}, "r must be a positive integer"),
])  # fmt: skip
def test_malformed_configs_are_lora_errors(tmp_path, conf, match):
    refused(adapter(tmp_path / "a", conf), match)


def test_config_values_are_not_echoed(tmp_path):
    for conf in ({"peft_type": "SECRET_TOKEN_abc123", "r": 2}, {"peft_type": "LORA", "r": "SECRET_TOKEN_abc123"},
                 {"peft_type": "LORA", "r": 2, "bias": "SECRET_TOKEN_abc123"}):  # fmt: skip
        with pytest.raises(LoRAError) as e:
            load_adapter("x", adapter(tmp_path / "a", conf), CFG, max_rank=8)
        assert "SECRET" not in str(e.value)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused(tmp_path, bad):
    b = torch.randn(16, 2)
    b[3, 1] = bad
    refused(adapter(tmp_path / "a", b=b), "not finite")


def test_an_oversized_config_is_refused_unread(tmp_path):
    path = adapter(tmp_path / "a")
    with open(path / "adapter_config.json", "r+b") as f:  # sparse: large on paper, nothing written
        f.truncate(2 << 30)
    refused(path, f"more than {MAX_CONFIG_BYTES}")


def test_a_safetensors_header_claiming_gigabytes_is_refused_unread(tmp_path):
    path = adapter(tmp_path / "a")
    with open(path / "adapter_model.safetensors", "r+b") as f:  # sparse: the header it claims is "there"
        f.write(struct.pack("<Q", 1 << 30))
        f.truncate((1 << 30) + (2 << 20))
    refused(path, f"header of {1 << 30} bytes \\(more than {MAX_HEADER_BYTES}\\)")


def test_a_path_the_os_refuses_is_a_lora_error(tmp_path):
    refused(tmp_path / ("x" * 300), "cannot read|no adapter_config.json")
    if os.geteuid() != 0:  # root reads anything
        path = adapter(tmp_path / "locked")
        (path / "adapter_config.json").chmod(0)
        refused(path, "cannot read")
