"""AsyncEngine: concurrent asyncio consumers, early exit aborts, a failing request
does not take the loop or its neighbours down."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenmill import SamplingParams
from tokenmill.engine.api.streams import RequestFailedError
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.errors import InvalidRequestError

PROMPTS = ["The sun is", "Water boils at", "My favourite book is", "Cats and dogs"]


class FaultInjectingRunner:
    """Wraps the real runner; raises whenever a batch contains the poisoned request."""

    def __init__(self, runner, poisoned: str) -> None:
        self.runner, self.poisoned = runner, poisoned

    def execute(self, batch, grammar=None):
        if any(s.request_id == self.poisoned for s in batch.scheduled):
            raise RuntimeError("injected fault")
        return self.runner.execute(batch, grammar)


async def collect(engine, rid, prompt, params):
    text, last = "", None
    async for out in engine.generate(rid, prompt, params):
        text += out.delta_text
        last = out
    return text, last


@pytest.fixture
def start_async(llm):
    """Start the background loop on the shared engine (offline calls must come before)."""
    engines = []

    def start() -> AsyncEngine:
        engines.append(AsyncEngine(llm.engine))
        return engines[-1]

    yield start
    for e in engines:
        e.shutdown()
    llm.engine.core.runner = getattr(llm.engine.core.runner, "runner", llm.engine.core.runner)


def test_concurrent_streams_match_offline(llm, start_async):
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = [o.text for o in llm.generate(PROMPTS, params)]
    async_engine = start_async()

    async def main():
        return await asyncio.gather(*(collect(async_engine, f"r{i}", p, params) for i, p in enumerate(PROMPTS)))

    results = asyncio.run(main())
    assert [text for text, _ in results] == expected
    assert all(last.finished and last.outputs[0].text == text for text, last in results)


def test_leaving_early_aborts_and_frees_blocks(llm, start_async):
    async_engine = start_async()

    async def main():
        async for _ in async_engine.generate("leaver", "Tell me a long story.", SamplingParams(max_tokens=200)):
            break  # the client disconnects after one token
        for _ in range(100):
            if not llm.engine.has_unfinished():
                return
            await asyncio.sleep(0.05)

    asyncio.run(main())
    assert llm.engine.core.block_pool.num_free == llm.engine.core.block_pool.num_blocks


def test_a_failing_request_fails_alone(llm, start_async):
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = llm.generate(PROMPTS[0], params)[0].text
    llm.engine.core.runner = FaultInjectingRunner(llm.engine.core.runner, poisoned="bad")
    async_engine = start_async()

    async def main():
        good = asyncio.create_task(collect(async_engine, "good", PROMPTS[0], params))
        with pytest.raises(RequestFailedError, match="injected fault"):
            await collect(async_engine, "bad", PROMPTS[1], params)
        text, _ = await good
        after, _ = await collect(async_engine, "after", PROMPTS[0], params)  # the loop lives on
        return text, after

    text, after = asyncio.run(main())
    assert text == expected and after == expected


def test_invalid_request_raises_to_its_caller(start_async):
    async_engine = start_async()

    async def main():
        async for _ in async_engine.generate("empty", "", SamplingParams()):
            pass

    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        asyncio.run(main())


def test_n_sequences_finishing_in_the_same_step_all_reach_the_stream(llm, start_async):
    """n=3 with max_tokens=2: all three end in one step; each must deliver its last output."""
    async_engine = start_async()

    async def main():
        finished = []
        async for out in async_engine.generate("n3", "Hi", SamplingParams(n=3, max_tokens=2, seed=1)):
            if out.finished:
                finished.append(out.outputs[0].index)
        return finished

    assert sorted(asyncio.run(asyncio.wait_for(main(), timeout=60))) == [0, 1, 2]


def test_a_grammar_slower_than_its_compile_timeout_is_refused_and_a_retry_is_cached(llm, start_async):
    """Issue 24 item 2, the threaded front: the compile waits on the engine's compile
    thread for at most ``grammar_compile_timeout``; then the request is refused, the
    running compile finishes into the cache, and a retry is served."""
    from tokenmill.configuration.config import StructuredConfig
    from tokenmill.structured.grammar import GrammarCompiler

    structured = llm.engine.core.structured
    default = structured.compiler
    structured.compiler = GrammarCompiler(
        llm.tokenizer, default.vocab_size, StructuredConfig(grammar_compile_timeout=0.05)
    )
    try:
        async_engine = start_async()
        props = {f"k{i}": {"type": "integer"} for i in range(2000)}
        params = SamplingParams(
            max_tokens=2, structured={"json": {"type": "object", "properties": props, "required": list(props)}}
        )
        with pytest.raises(InvalidRequestError, match="--grammar-compile-timeout"):
            asyncio.run(collect(async_engine, "slow", "x", params))
        deadline = time.time() + 60  # (a loaded 2-core machine took over 10 s)
        while structured.compiler.cached(params.structured) is None:
            assert time.time() < deadline, "the compile never reached the cache"
            time.sleep(0.05)
        assert asyncio.run(collect(async_engine, "retry", "x", params))[1].finished
    finally:
        structured.compiler = default
