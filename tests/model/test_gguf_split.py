"""A GGUF split in parts by llama.cpp's gguf-split (``NAME-00001-of-0000N.gguf``), as Hub repos ship
large models: read whole from its first part, the same weights as the unsplit file; a missing part or
a later part given alone is a clear error."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import write_tiny_llama_gguf
from tokenmill.errors import ModelLoadError
from tokenmill.model.loader import load_checkpoint


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    write_tiny_llama_gguf(root / "whole.gguf", "Q8_0")
    write_tiny_llama_gguf(root / "split.gguf", "Q8_0", split_max_tensors=8)
    return root


def test_a_split_gguf_loads_the_same_weights_as_the_whole_file(files):
    parts = sorted(files.glob("split-*-of-*.gguf"))
    assert len(parts) == 3
    whole = load_checkpoint(files / "whole.gguf", progress=False)
    split = load_checkpoint(parts[0], progress=False)
    assert split.config == whole.config
    assert whole.weights.keys() == split.weights.keys()
    for name, w in whole.weights.items():
        assert torch.equal(w, split.weights[name]), name


def test_a_later_part_alone_or_a_missing_part_is_named(files, tmp_path):
    with pytest.raises(
        ModelLoadError, match=r"one part of a GGUF split in 3: give the first part \(split-00001-of-00003"
    ):
        load_checkpoint(files / "split-00002-of-00003.gguf", progress=False)
    for part in ("00001", "00002"):
        (tmp_path / f"split-{part}-of-00003.gguf").symlink_to(files / f"split-{part}-of-00003.gguf")
    with pytest.raises(ModelLoadError, match="split in 3 parts and part 3 is missing"):
        load_checkpoint(tmp_path / "split-00001-of-00003.gguf", progress=False)
