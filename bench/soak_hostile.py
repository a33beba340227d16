"""The hostile clients of issue 57, for `bench/soak.py --mix abuse` (bench/soak_abuse.py).

Each is an episode that ``AbuseSoak.every`` runs now and then through the abuse phase,
beside the well-behaved clients, and judges:

- ``template_bomb``: chats whose own ``chat_template`` (the server trusts request
  templates) asks for a gigabyte of output, loops 10^10 times (seven of these at once:
  they had filled the pool that tokenises) or overflows Jinja's ``range``: each must be
  a 400 in OpenAI's shape (or a 429 while every render worker is busy) within
  ``TEMPLATE_ANSWER_S``.
- ``priority_flood``: for ``PRIORITY_FLOOD_S`` seconds, ``PRIORITY_LOOPS`` loops of short
  completions at priority -1000 from a key the operator allowed to raise its priority
  (``--priority-api-key``: a premium tenant), and ``UNPRIVILEGED_LOOPS`` loops at -1000
  from a client without such a key, each of which must be a 400 (any client could send
  any value, and 96 such loops had kept a priority-0 client waiting 45 s); the
  well-behaved clients (priority 0) must still be served (their TTFT is the soak's
  verdict), and a request at priority 0 sent mid-flood is timed.
- ``forged_ids``: requests of several prompts, each with a new random bearer token, from
  one address of their own: without ``--api-key`` for those tokens, the server must take
  them all for one client (its fairness window), not one client each.
- ``heavy_embeddings``: 2,048 inputs of ~127 tokens each (under the token limit) from
  one client: it must be answered, and the others must keep being served meanwhile.

Each kind of client comes from an address of its own on the loopback (``ADDRESSES``):
without a valid key, the server tells clients apart by address.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time

import httpx

HOSTILE = ("template_bomb", "priority_flood", "forged_ids", "heavy_embeddings")
GAPS = {
    "template_bomb": (30, 60),
    "priority_flood": (60, 120),
    "forged_ids": (20, 40),
    "heavy_embeddings": (10, 600),  # the first early in the phase: minutes to run before the kill
}  # seconds between two episodes
ADDRESSES = {
    "template_bomb": "127.0.0.6",
    "priority_flood": "127.0.0.7",
    "forged_ids": "127.0.0.8",
    "heavy_embeddings": "127.0.0.9",
}
PRIORITY_KEY = "soak-priority"  # a --priority-api-key: may send a priority below 0
TEMPLATE_ANSWER_S = 12.0  # --request-template-timeout (5 s) to render, or to wait for a worker
TEMPLATES = {
    "huge_output": "{{ 'a' * 10**9 }}",
    "nested_loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
    "range_overflow": "{% for i in range(100001) %}{% endfor %}x",
}
NESTED_AT_ONCE = 7
PRIORITY_LOOPS, UNPRIVILEGED_LOOPS, PRIORITY_FLOOD_S = 8, 8, 45.0
FORGED_REQUESTS, FORGED_PROMPTS = 8, 8
HEAVY_INPUTS, HEAVY_TIMEOUT_S = 2048, 900.0
WORDS = (
    "river stone cloud bright quiet garden window paper silver market engine forest "
    "yellow bridge morning winter table candle harbor letter orange planet thunder"
).split()


def client(url: str, address: str, key: str | None, timeout: float) -> httpx.AsyncClient:
    """A client whose connections come from ``address`` (a loopback address of its own)."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    transport = httpx.AsyncHTTPTransport(local_address=address)
    return httpx.AsyncClient(base_url=url, timeout=timeout, headers=headers, transport=transport)


def error_message(resp: httpx.Response) -> str | None:
    try:
        err = resp.json().get("error")
    except (ValueError, AttributeError):
        return None
    if isinstance(err, dict) and {"message", "type"} <= set(err):
        return str(err["message"])
    return None


async def template_bomb(url: str, ev: dict) -> None:
    """The three templates, the loop seven times, all at once; each a 400 within seconds."""

    async def one(c: httpx.AsyncClient, name: str) -> dict:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "chat_template": TEMPLATES[name]}
        start = time.perf_counter()
        try:
            resp = await c.post("/v1/chat/completions", json=body)
            out = {"status": resp.status_code, "message": (error_message(resp) or "")[:160]}
        except httpx.HTTPError as e:
            out = {"status": type(e).__name__, "message": ""}
        return {"template": name, "s": time.perf_counter() - start, **out}

    names = ["huge_output", "range_overflow", *["nested_loops"] * NESTED_AT_ONCE]
    async with client(url, ADDRESSES["template_bomb"], None, 120) as c:
        res = await asyncio.gather(*[one(c, n) for n in names])
    ev["answers"] = res
    ev["status"] = ",".join(sorted({str(r["status"]) for r in res}))
    ev["slowest_s"] = max(r["s"] for r in res)
    # 429: every render worker was busy (the pool is bounded: --request-template-workers)
    ev["ok"] = all(r["status"] in (400, 429) and r["message"] and r["s"] < TEMPLATE_ANSWER_S for r in res)


async def priority_flood(url: str, ev: dict, rng: random.Random) -> None:
    """``PRIORITY_LOOPS`` loops at priority -1000 for ``PRIORITY_FLOOD_S`` s; meanwhile one
    request at priority 0 from the same address, timed."""
    statuses: list[int | str] = []
    refused: list[int | str] = []  # the unprivileged loops' answers: 400s naming the flags
    stop = time.perf_counter() + PRIORITY_FLOOD_S

    async def loop(c: httpx.AsyncClient, into: list) -> None:
        while time.perf_counter() < stop:
            body = {"prompt": f"Flood {rng.randint(0, 10**9)}: count to ten", "max_tokens": 24, "priority": -1000}
            try:
                resp = await c.post("/v1/completions", json=body)
                named = resp.status_code != 400 or "--priority-api-key" in (error_message(resp) or "")
                into.append(resp.status_code if named else "400 without the flag's name")
            except httpx.HTTPError as e:
                into.append(type(e).__name__)
                await asyncio.sleep(0.5)  # the server is down (the core killed): no spin
            if into is refused:
                await asyncio.sleep(0.5)  # a refusal is instant: a loop, not a spin

    async def probe(c: httpx.AsyncClient) -> None:
        await asyncio.sleep(PRIORITY_FLOOD_S / 3)
        start = time.perf_counter()
        body = {"prompt": "A plain question: what is two and two?", "max_tokens": 8, "priority": 0}
        try:
            ev["probe_status"] = (await c.post("/v1/completions", json=body)).status_code
        except httpx.HTTPError as e:
            ev["probe_status"] = type(e).__name__
        ev["probe_s"] = time.perf_counter() - start

    async with (
        client(url, ADDRESSES["priority_flood"], PRIORITY_KEY, 300) as flood,
        client(url, ADDRESSES["priority_flood"], None, 300) as plain,
    ):
        await asyncio.gather(
            *[loop(flood, statuses) for _ in range(PRIORITY_LOOPS)],
            *[loop(plain, refused) for _ in range(UNPRIVILEGED_LOOPS)],
            probe(plain),
        )
    counts: dict[str, int] = {}
    for s in statuses:
        counts[str(s)] = counts.get(str(s), 0) + 1
    ev["status"], ev["requests"] = counts, len(statuses)
    ev["unprivileged"] = {str(s): refused.count(s) for s in set(refused)}
    ev["ok"] = set(counts) == {"200"} and set(ev["unprivileged"]) == {"400"} and ev.get("probe_status") == 200


async def forged_ids(url: str, ev: dict, rng: random.Random) -> None:
    """Requests of several prompts, a fresh random bearer token each, all at once."""

    async def one() -> int | str:
        body = {
            "prompt": [f"Forged {rng.randint(0, 10**9)}: tell a story" for _ in range(FORGED_PROMPTS)],
            "max_tokens": 16,
        }
        async with client(url, ADDRESSES["forged_ids"], secrets.token_hex(16), 300) as c:
            try:
                resp = await c.post("/v1/completions", json=body)
                return resp.status_code if resp.status_code != 200 else len(resp.json()["choices"])
            except httpx.HTTPError as e:
                return type(e).__name__

    res = await asyncio.gather(*[one() for _ in range(FORGED_REQUESTS)])
    ev["status"] = ",".join(sorted({str(r) if r != FORGED_PROMPTS else "200" for r in res}))
    ev["ok"] = all(r == FORGED_PROMPTS for r in res)


def long_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def heavy_embeddings(url: str, ev: dict, rng: random.Random) -> None:
    """2,048 inputs of about 127 tokens each, in one request; answered whole."""
    inputs = [f"{i}: {long_text(rng, 120)}" for i in range(HEAVY_INPUTS)]
    start = time.perf_counter()
    async with client(url, ADDRESSES["heavy_embeddings"], None, HEAVY_TIMEOUT_S) as c:
        try:
            resp = await c.post("/v1/embeddings", json={"input": inputs, "encoding_format": "base64"})
            ev["status"] = resp.status_code
            ev["embeddings"] = len(resp.json().get("data", [])) if resp.status_code == 200 else 0
            ev["prompt_tokens"] = resp.json().get("usage", {}).get("prompt_tokens") if resp.status_code == 200 else 0
        except httpx.HTTPError as e:
            ev["status"], ev["embeddings"] = type(e).__name__, 0
    ev["s"] = time.perf_counter() - start
    ev["ok"] = ev["status"] == 200 and ev["embeddings"] == HEAVY_INPUTS


EXPECT = {
    "template_bomb": f"hostile request templates (1 GB output, 7 nested 10^10 loops, range overflow): "
    f"400 (429 when the render workers are busy) in OpenAI's shape within {TEMPLATE_ANSWER_S:g} s",
    "priority_flood": f"{PRIORITY_FLOOD_S:g} s of priority -1000: {PRIORITY_LOOPS} loops with a --priority-api-key "
    f"all served, {UNPRIVILEGED_LOOPS} without one all 400, a priority-0 request served meanwhile",
    "forged_ids": f"{FORGED_REQUESTS} requests of {FORGED_PROMPTS} prompts, each a new random bearer: all served",
    "heavy_embeddings": f"{HEAVY_INPUTS} embedding inputs of ~127 tokens: answered whole",
}


def summary(kind: str, evs: list[dict]) -> dict:
    """What the report keeps of these episodes beyond statuses."""
    if kind == "template_bomb":
        return {"slowest_s": max((e.get("slowest_s", 0) for e in evs), default=None)}
    if kind == "priority_flood":
        return {
            "requests": sum(e.get("requests", 0) for e in evs),
            "unprivileged": [e.get("unprivileged") for e in evs],
            "probe_s": [round(e["probe_s"], 2) for e in evs if "probe_s" in e],
        }
    if kind == "heavy_embeddings":
        return {"seconds": [round(e["s"], 1) for e in evs if "s" in e], "tokens": [e.get("prompt_tokens") for e in evs]}
    return {}
