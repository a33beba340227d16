"""Bad model files and bad requests fail at once with an error that names the problem."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError, ModelLoadError
from tokenmill.model.loader import load_checkpoint
from tokenmill.model.paths import default_model_path


def write_gguf(path, arch="llama", tensor_type=None):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_context_length(64)
    if tensor_type is None:
        w.add_tensor("token_embd.weight", np.zeros((10, 32), dtype=np.float32))
    else:
        qtype = gguf.GGMLQuantizationType[tensor_type]
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        w.add_tensor("token_embd.weight", np.zeros((10, 256 // block * type_size), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_missing_file():
    with pytest.raises(ModelLoadError, match="does not exist: /no/such/model.gguf"):
        load_checkpoint("/no/such/model.gguf")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_checkpoint(bad)


@pytest.mark.parametrize("size", [100_000, 60_000_000], ids=["in-header", "in-tensor-data"])
def test_truncated_gguf(tmp_path, size):
    cut = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as f:
        cut.write_bytes(f.read(size))
    with pytest.raises(ModelLoadError, match="truncated GGUF file"):
        load_checkpoint(cut)


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_checkpoint(write_gguf(tmp_path / "gpt2.gguf", arch="gpt2"))


def test_unsupported_quantisation_type(tmp_path):
    with pytest.raises(ModelLoadError, match="unsupported GGUF tensor type IQ2_XXS"):
        load_checkpoint(write_gguf(tmp_path / "iq2.gguf", tensor_type="IQ2_XXS"))


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_checkpoint(tmp_path)


def test_unsupported_hf_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt_neox"}')
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt_neox'"):
        load_checkpoint(tmp_path)


def test_prompt_longer_than_context_window(llm):
    too_long = [42] * llm.max_model_len
    with pytest.raises(InvalidRequestError, match=f"prompt is {llm.max_model_len} tokens but the context window is"):
        llm.generate([too_long], SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished()


def test_empty_prompt(llm):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([""], SamplingParams(max_tokens=1))


def test_generation_stops_at_the_context_window():
    small = LLM(max_model_len=24, kv_cache_memory="16MiB", progress=False)
    out = small.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == 24


def test_invalid_dtype_and_device():
    with pytest.raises(Exception, match="unsupported dtype 'float8'"):
        LLM(dtype="float8", progress=False)
