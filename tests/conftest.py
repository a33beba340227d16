"""Shared fixtures: the real model (ours and the transformers oracle) and tiny models."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.block_pool import BlockPool


@pytest.fixture(scope="session")
def llm():
    from tokenmill import LLM

    return LLM(dtype="float32", progress=False)


@pytest.fixture(scope="session")
def hf_model(llm):
    transformers = pytest.importorskip("transformers")
    path = llm.model_path
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(llm):
    transformers = pytest.importorskip("transformers")
    path = llm.model_path
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(autouse=True)
def no_leaked_blocks(request):
    """Every test that used the shared LLM must leave its KV pool fully free."""
    yield
    if "llm" in request.fixturenames:
        llm = request.getfixturevalue("llm")
        pool: BlockPool = llm.engine.block_pool
        assert pool.num_free == pool.num_blocks, f"{pool.num_blocks - pool.num_free} KV blocks leaked"
        assert not llm.engine.has_unfinished()
