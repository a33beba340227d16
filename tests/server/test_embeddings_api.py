"""/v1/embeddings through the official client: the offline engine's embeddings, float
or base64, text or token ids, while chat traffic runs; bad input refused."""

from __future__ import annotations

import asyncio
import base64
import struct

import pytest

from tests.server.conftest import API_KEY, MODEL

openai = pytest.importorskip("openai")

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France."]


def test_embeddings_equal_the_offline_engine(client, llm):
    r = client.embeddings.create(model=MODEL, input=TEXTS)
    want = llm.embed(TEXTS)
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == sum(
        len(llm.tokenizer.encode(t)) for t in TEXTS
    )
    for d, w in zip(r.data, want, strict=True):
        assert max(abs(a - b) for a, b in zip(d.embedding, w, strict=True)) < 1e-5
    raw = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="base64").data[0].embedding
    floats = struct.unpack(f"<{len(want[0])}f", base64.b64decode(raw)) if isinstance(raw, str) else raw
    assert max(abs(a - b) for a, b in zip(floats, want[0], strict=True)) < 1e-5
    ids = llm.tokenizer.encode(TEXTS[1])
    by_ids = client.embeddings.create(model=MODEL, input=[ids]).data[0].embedding
    assert max(abs(a - b) for a, b in zip(by_ids, want[1], strict=True)) < 1e-5
    mean = client.embeddings.create(model=MODEL, input=TEXTS[0], extra_body={"pooling": "mean"}).data[0].embedding
    assert max(abs(a - b) for a, b in zip(mean, llm.embed(TEXTS[0], pooling="mean")[0], strict=True)) < 1e-5


def test_embeddings_and_chat_run_together(server):
    async def go():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        chats = [
            c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=16, temperature=0
            )
            for i in range(4)
        ]
        embeds = [c.embeddings.create(model=MODEL, input=[f"text {i}", f"other {i}"]) for i in range(4)]
        return await asyncio.gather(*chats, *embeds)

    results = asyncio.run(go())
    assert all(r.choices[0].message.content for r in results[:4])
    assert all(len(r.data) == 2 and len(r.data[0].embedding) == len(r.data[1].embedding) > 0 for r in results[4:])


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input": []}, "input is empty"),
        ({"input": ""}, "input[0] is empty"),
        ({"input": "hi", "dimensions": 64}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "pooling": "max"}, "pooling"),
        ({"input": "x " * 9000}, "maximum context length"),
        ({"input": [[10**9]]}, "outside the vocabulary"),
        ({"input": "hi", "foo": 1}, "Unrecognized request argument supplied: foo"),
    ],
)
def test_bad_embedding_requests_are_400(http, body, needle):
    r = http.post("/v1/embeddings", json={"model": MODEL, **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
