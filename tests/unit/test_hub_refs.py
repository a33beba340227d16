"""Which Hub repo a model argument names, and which of the repo's files it means: the id forms other
engines take, llama.cpp's quant tags (split parts, projectors left out), a safetensors repo's shards
and nothing of its other formats."""

from __future__ import annotations

import pytest

from tokenmill.errors import ModelLoadError
from tokenmill.hub.refs import HubRef, choose_files, gguf_choices, gguf_quant, parse_ref


@pytest.mark.parametrize(
    "text, ref",
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", HubRef("Qwen/Qwen2.5-0.5B-Instruct")),
        ("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", HubRef("bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M")),
        ("hf.co/unsloth/gemma-3-1b-it-GGUF:q8_0", HubRef("unsloth/gemma-3-1b-it-GGUF", "q8_0")),
        ("hf.co/org/name:latest", HubRef("org/name")),  # Ollama's default tag: the default choice
        ("https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/", HubRef("HuggingFaceTB/SmolLM2-135M-Instruct")),
        ("model.gguf", None),
        ("a/b/c", None),
        ("./org/name", None),
        ("org/../name", None),
        ("org/name:", None),
        ("org--x/name", None),
        ("-org/name", None),
    ],
)
def test_the_id_forms_users_copy_from_other_engines(text, ref):
    assert parse_ref(text) == ref


@pytest.mark.parametrize(
    "name, tag",
    [
        ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
        ("qwen2.5-0.5b-instruct-q8_0.gguf", "Q8_0"),
        ("Meta-Llama-3.1-70B-Instruct-IQ4_XS-00001-of-00002.gguf", "IQ4_XS"),
        ("Q4_K_M/Model-Q4_K_M-00002-of-00003.gguf", "Q4_K_M"),
        ("phi-2.BF16.gguf", "BF16"),
        ("Qwen2-7B-f16.gguf", "F16"),
        ("Qwen2-7B.gguf", None),
    ],
)
def test_a_gguf_files_quant_tag_comes_from_its_name(name, tag):
    assert gguf_quant(name) == tag


NAMES = [
    "README.md",
    "mmproj-model-f16.gguf",
    "Model-Q8_0.gguf",
    "Model-Q4_K_M.gguf",
    "Q6_K/Model-Q6_K-00002-of-00002.gguf",
    "Q6_K/Model-Q6_K-00001-of-00002.gguf",
]


def test_a_tag_picks_its_files_case_blind_and_a_split_model_all_its_parts_in_order():
    assert "MMPROJ" not in " ".join(gguf_choices(NAMES))  # a projector is not a model
    q6 = choose_files(HubRef("o/m", "q6_k"), NAMES)
    assert q6.kind == "gguf" and q6.quant == "Q6_K"
    assert q6.files == ("Q6_K/Model-Q6_K-00001-of-00002.gguf", "Q6_K/Model-Q6_K-00002-of-00002.gguf")
    assert q6.entry == q6.files[0]
    assert choose_files(HubRef("o/m"), NAMES).files == ("Model-Q4_K_M.gguf",)  # no tag: Q4_K_M, as llama.cpp
    with pytest.raises(ModelLoadError, match="has no Q5_K_S GGUF; its tags: Q4_K_M, Q6_K, Q8_0"):
        choose_files(HubRef("o/m", "Q5_K_S"), NAMES)
    with pytest.raises(ModelLoadError, match="no Q4_K_M GGUF, the default: name one of its tags"):
        choose_files(HubRef("o/m"), [n for n in NAMES if "Q4_K_M" not in n])
    assert choose_files(HubRef("o/m"), ["only-Q8_0.gguf"]).files == ("only-Q8_0.gguf",)  # the only one
    with pytest.raises(ModelLoadError, match="split parts are incomplete"):
        choose_files(HubRef("o/m", "Q6_K"), [n for n in NAMES if "00002-of" not in n])


def test_a_safetensors_repo_means_its_config_tokenizer_and_shards_never_its_other_formats():
    names = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "consolidated.safetensors",  # Mistral's own format beside the transformers one
        "pytorch_model.bin",
        "onnx/model.onnx",
        "original/model.safetensors",
        "README.md",
    ]
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    files = choose_files(HubRef("o/m"), names, lambda n: index)
    assert files.kind == "safetensors" and files.entry == ""
    assert set(files.files) == {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    unreadable_index = choose_files(HubRef("o/m"), names, lambda n: {})
    assert unreadable_index.files[-2:] == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    assert choose_files(HubRef("o/m"), names).files[-2:] == (
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    )  # the index unread (a cached snapshot without it): the transformers-named shards


def test_an_adapter_repo_and_repos_with_nothing_to_serve():
    adapter = choose_files(HubRef("o/lora"), ["adapter_config.json", "adapter_model.safetensors", "README.md"])
    assert adapter.kind == "adapter" and adapter.files == ("adapter_config.json", "adapter_model.safetensors")
    with pytest.raises(ModelLoadError, match="holds no safetensors or GGUF weights .*never pickled"):
        choose_files(HubRef("o/old"), ["config.json", "pytorch_model.bin"])
    with pytest.raises(ModelLoadError, match="no config.json"):
        choose_files(HubRef("o/m"), ["model.safetensors"])
    with pytest.raises(ModelLoadError, match="names a GGUF quant, but o/m on the Hub has no GGUF files"):
        choose_files(HubRef("o/m", "Q4_K_M"), ["config.json", "model.safetensors"])
