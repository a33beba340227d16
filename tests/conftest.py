"""Shared fixtures: the real model (ours and the transformers oracle) and tiny models;
and the test tiers, marked by where a test lives (``-m unit``: no weights, seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.engine.core.block_pool import BlockPool

TESTS = Path(__file__).parent
# tests that start other processes (servers, torch.distributed workers, the CLI, other builds)
SUBPROCESS_FILES = {
    "test_cli.py",
    "test_parallel.py",
    "test_imports.py",
    "test_lifetime.py",
    "test_malloc_options.py",
    "test_template_sandbox.py",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """unit / model / server from the directory; subprocess for the files above, the server
    tier, and tests marked so one by one."""
    for item in items:
        parts = Path(item.fspath).relative_to(TESTS).parts
        tier = parts[0] if len(parts) > 1 else "server"  # (tests/test_cli.py drives the CLI)
        item.add_marker(getattr(pytest.mark, tier))
        if tier == "server" or parts[-1] in SUBPROCESS_FILES:
            item.add_marker(pytest.mark.subprocess)


@pytest.fixture(scope="session")
def llm():
    from tokenmill import LLM

    return LLM(dtype="float32", progress=False)


@pytest.fixture(scope="session")
def float_llm():
    """The exact arithmetic (a GGUF's weights widened, multiplied in float): transformers' numbers,
    what the comparisons with the transformers oracle run."""
    from tokenmill import LLM

    return LLM(dtype="float32", quant_arithmetic="float", progress=False, kv_cache_memory="256MiB")


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
    for name in ("llm", "float_llm"):
        if name in request.fixturenames:
            llm = request.getfixturevalue(name)
            pool: BlockPool = llm.engine.core.block_pool
            assert pool.num_free == pool.num_blocks, f"{pool.num_blocks - pool.num_free} KV blocks leaked"
            assert not llm.engine.has_unfinished()
