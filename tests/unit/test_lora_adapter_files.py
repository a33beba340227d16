"""Adapter folders a hostile client points the server at (issue 24, items 4, 6, 7, 8):
each is a LoRAError (the server's 400), never another exception (a 500); nothing is
read whole before its size is checked; a path that holds no adapter gets one message
whatever the reason (the reason is logged), and --lora-root fences the paths."""

from __future__ import annotations

import math
import os
import struct

import pytest
import torch

from tests.helpers import LORA_CFG as CFG
from tests.helpers import tiny_adapter as adapter
from tokenmill.lora.adapter import MAX_CONFIG_BYTES, MAX_HEADER_BYTES, NOT_LOADABLE, LoRAError, load_adapter


def refused(path, match):
    with pytest.raises(LoRAError, match=match):
        load_adapter("x", path, CFG, max_rank=8)


def not_loadable(path, caplog, reason):
    """Refused with the one message that does not tell why; the log tells why."""
    caplog.clear()
    with pytest.raises(LoRAError) as e:
        load_adapter("x", path, CFG, max_rank=8)
    assert str(e.value) == f"LoRA adapter 'x': {NOT_LOADABLE}"
    assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_good_adapter_loads(tmp_path):
    a = load_adapter("x", adapter(tmp_path / "a"), CFG, max_rank=8)
    assert a.rank == 2 and a.scaling == 2.0 and a.targets == {"q_proj"}


@pytest.mark.parametrize(
    ("conf", "match"),
    [
        ({"peft_type": "LORA", "r": 2, "lora_alpha": None}, "lora_alpha must be a finite number"),
        ({"peft_type": "LORA", "r": 2, "lora_alpha": "8"}, "lora_alpha must be a finite number"),
        ('{"peft_type": "LORA", "r": 2, "lora_alpha": NaN}', "lora_alpha must be a finite number"),
        ('{"peft_type": "LORA", "r": 2, "lora_alpha": Infinity}', "lora_alpha must be a finite number"),
        ({"peft_type": "LORA", "r": "SECRET_TOKEN_abc123"}, "r must be a positive integer"),
    ],
)
def test_malformed_configs_are_lora_errors(tmp_path, conf, match):
    refused(adapter(tmp_path / "a", conf), match)


@pytest.mark.parametrize(
    ("conf", "reason"),
    [
        ([{"r": 2}], "does not hold a JSON object"),
        ("[" * 200_000 + "]" * 200_000, "not valid JSON"),
        ("{not json", "not valid JSON"),
    ],
)
def test_a_config_that_is_not_an_object_is_not_loadable(tmp_path, caplog, conf, reason):
    not_loadable(adapter(tmp_path / "a", conf), caplog, reason)


def test_config_values_are_not_echoed(tmp_path):
    for conf in (
        {"peft_type": "SECRET_TOKEN_abc123", "r": 2},
        {"peft_type": "LORA", "r": "SECRET_TOKEN_abc123"},
        {"peft_type": "LORA", "r": 2, "bias": "SECRET_TOKEN_abc123"},
    ):
        with pytest.raises(LoRAError) as e:
            load_adapter("x", adapter(tmp_path / "a", conf), CFG, max_rank=8)
        assert "SECRET" not in str(e.value)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused(tmp_path, bad):
    b = torch.randn(16, 2)
    b[3, 1] = bad
    refused(adapter(tmp_path / "a", b=b), "not finite")


def test_an_oversized_config_is_refused_unread(tmp_path, caplog):
    path = adapter(tmp_path / "a")
    with open(path / "adapter_config.json", "r+b") as f:  # sparse: large on paper, nothing written
        f.truncate(2 << 30)
    not_loadable(path, caplog, f"more than {MAX_CONFIG_BYTES}")


def test_a_safetensors_header_claiming_gigabytes_is_refused_unread(tmp_path, caplog):
    path = adapter(tmp_path / "a")
    with open(path / "adapter_model.safetensors", "r+b") as f:  # sparse: the header it claims is "there"
        f.write(struct.pack("<Q", 1 << 30))
        f.truncate((1 << 30) + (2 << 20))
    not_loadable(path, caplog, f"header of {1 << 30} bytes (more than {MAX_HEADER_BYTES})")


def test_every_path_without_an_adapter_gets_one_message(tmp_path, caplog):
    """Issue 24 item 8: nothing there, a file, a folder without the files, a name the
    OS refuses, no permission: a client cannot tell which (so cannot map the disk)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    not_loadable(tmp_path / "nothing", caplog, "no file adapter_config.json")
    not_loadable(tmp_path / "file", caplog, "no file adapter_config.json")
    not_loadable(tmp_path / "empty", caplog, "no file adapter_config.json")
    not_loadable(tmp_path / ("x" * 300), caplog, "File name too long")
    half = adapter(tmp_path / "half")
    (half / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    not_loadable(half, caplog, "cannot read adapter_model.safetensors")
    if os.geteuid() != 0:  # root reads anything
        path = adapter(tmp_path / "locked")
        (path / "adapter_config.json").chmod(0)
        not_loadable(path, caplog, "cannot read it")


def test_lora_root_refuses_paths_outside_it(tmp_path):
    root = tmp_path / "adapters"
    inside = adapter(root / "good")
    outside = adapter(tmp_path / "elsewhere")
    (root / "link").symlink_to(outside)
    assert load_adapter("x", inside, CFG, max_rank=8, root=root).rank == 2
    for path in (outside, root / "link", root / ".." / "elsewhere", tmp_path / "nothing"):
        with pytest.raises(LoRAError, match="outside the folder this server loads adapters from"):
            load_adapter("x", path, CFG, max_rank=8, root=root)
