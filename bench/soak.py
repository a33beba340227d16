"""Soak test: a real `tokenmill serve` at saturation for a long while, abused.

    python bench/soak.py [--duration 600] [--concurrency 16]
    python bench/soak.py --mix grammars --duration 600   # + structured output, tools, LoRA
    python bench/soak.py --mix abuse --baseline-duration 300 --duration 600   # + abusers, a core killed


For `--duration` seconds, `--concurrency` clients keep requests in flight against a
server this script starts (the default model, on 127.0.0.1 only): streamed and
non-streamed completions and chats, `n` from 1 to 4, some clients that hang up
mid-request (streamed or not), and some bad inputs that must get a 4xx. Every 5 s
it samples the server's RSS and its running / waiting / KV-usage gauges. At the end
it waits for the server to go idle and checks that nothing is left: no running
request, KV usage back to zero. Writes results/soak.json and results/soak.png (RSS
over time, p99 latency per minute, load).

``--mix grammars`` (issue 24) runs two phases against one server started with LoRA,
runtime adapter loading and a KV pool small enough to preempt: first the plain mix
alone (the baseline), then the same plain mix with, beside it, constrained requests
(a JSON schema, a regex, a choice, a required tool call; every 200 checked against its
constraint), requests to adapters (two served from the start, others loaded and
unloaded at run time meanwhile), and now and then a burst of big distinct schemas to
compile. It reports the plain requests' time to first token in both phases (the
constrained and adapter traffic must not slow plain traffic down by more than 1.5x at
p99) and writes results/soak_grammars.json and .png.

``--mix abuse`` (issue 40, bench/soak_abuse.py) runs the plain mix's well-behaved
clients alone for ``--baseline-duration`` seconds, then beside abusers for
``--duration``: huge and dropped embeddings, 2,000-prompt completions, a deeply nested
schema, partial-body floods, special-token text, and the engine core killed and the
server restarted. It checks that every well-behaved request is answered, their TTFT p99
stays within 2x of the baseline's, /health within 0.2 s, nothing is left at the end,
prints PASS/FAIL lines (exit code 1 on any FAIL) and writes results/soak_abuse.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from tokenmill.loadgen.server_process import free_port

HERE = Path(__file__).parent
RESULTS = HERE / "results"
BAD_BODIES = [
    b'{"prompt": "\\ud800", "max_tokens": 4}',
    b'{"prompt": "hi", "max_tokens": "16"}',
    b'{"prompt": "hi", "top_k": 9223372036854775808, "top_p": 0.5}',
    b'{"prompt": "hi", "n": 1000000}',
    b'{"prompt": "hi", "logit_bias": {"1": 5}}',
    b'{"prompt": "hi", "max_tokens": 100000000}',
    b'{"messages": [], "max_tokens": 4}',
    b'{"prompt": "hi", "max_tokens": ',
]


async def read_stream(client, path: str, body: dict, row: dict, start: float) -> list[str]:
    """POST a streamed request; its status and time to first text go in ``row``; its data lines back."""
    lines = []
    async with client.stream("POST", path, json=body) as resp:
        row["status"] = resp.status_code
        async for ln in resp.aiter_lines():
            if ln.startswith("data: "):
                if "ttft" not in row and ('"text": "' in ln or '"content": "' in ln) and '"content": ""' not in ln:
                    row["ttft"] = time.perf_counter() - start
                lines.append(ln)
    return lines


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def wait_healthy(url: str, seconds: float = 120) -> None:
    """Until a server just started answers /health (it loads its model first)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up in {seconds:g} s")


def rss_mib(pid: int) -> float:
    """RSS of the server: its API process and its children (the engine core)."""
    return sum(rss_mib_of(p) for p in [pid, *children(pid)])


def rss_mib_of(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:  # gone meanwhile
        pass
    return 0.0


def rss_parts_mib(pid: int) -> dict[str, float]:
    """RSS split by process (API, core) and kind: anonymous memory can leak, file pages
    (shared libraries touched for the first time) only grow to the size of the files."""
    out = {}
    core = max(children(pid), key=lambda c: rss_mib_of(c), default=None)  # not a resource tracker
    for role, p in [("api", pid), ("core", core)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                key = {"RssAnon:": "anon", "RssFile:": "file"}.get(line.split(":")[0] + ":")
                if key:
                    out[f"{role}_{key}_mib"] = int(line.split()[1]) / 1024
        except OSError:
            pass
    return out


def direct_children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def children(pid: int) -> list[int]:
    out = direct_children(pid)
    return out + [g for c in out for g in children(c)]


def gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            if line.startswith(f"tokenmill:{name}{{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PHONE = r"\d{3}-\d{4}"
CHOICES = ["red", "green", "blue"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def valid(kind: str, text: str, calls: list | None) -> bool:
    """Does a finished constrained answer obey its constraint?"""
    import re

    try:
        if kind == "json":
            v = json.loads(text)
            return set(v) == {"name", "age"} and isinstance(v["name"], str) and isinstance(v["age"], int)
        if kind == "regex":
            return re.fullmatch(PHONE, text) is not None
        if kind == "choice":
            return text in CHOICES
        if kind == "tool":
            return bool(calls) and all(
                c["function"]["name"] == "get_weather" and set(json.loads(c["function"]["arguments"])) == {"city"}
                for c in calls
            )
    except (ValueError, KeyError, TypeError):
        return False
    return False


def write_adapter(path: Path, cfg, rank: int, seed: int) -> Path:
    """A PEFT adapter of random weights for the served model (q and v projections)."""
    import torch
    from safetensors.torch import save_file

    from tokenmill.lora.adapter import target_shapes

    g = torch.Generator().manual_seed(seed)
    shapes, tensors = target_shapes(cfg), {}
    for i in range(cfg.num_layers):
        for t in ("q_proj", "v_proj"):
            out, inp = shapes[t]
            tensors[f"base_model.model.model.layers.{i}.self_attn.{t}.lora_A.weight"] = (
                torch.randn(rank, inp, generator=g) * 0.02
            )
            tensors[f"base_model.model.model.layers.{i}.self_attn.{t}.lora_B.weight"] = (
                torch.randn(out, rank, generator=g) * 0.02
            )
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    conf = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(conf))
    return path


class Soak:
    def __init__(
        self, url: str, duration: float, seed: int, grammars: bool = False, adapter_paths: list[str] | None = None
    ) -> None:
        self.url, self.duration, self.rng = url, duration, random.Random(seed)
        self.grammars = grammars  # add constrained, adapter and big-schema requests to the mix
        self.adapter_paths = adapter_paths or []
        self.runtime_adapters: list[str] = []  # loaded at run time and not yet unloaded
        self.t0 = time.perf_counter()
        self.done: list[dict] = []  # one row per request
        self.churn: list[dict] = []  # runtime loads and unloads

    def body(self) -> tuple[str, dict]:
        r = self.rng
        n = r.choice([1, 1, 1, 2, 3, 4])
        common = {
            "max_tokens": r.randint(4, 48),
            "n": n,
            "temperature": r.choice([0, 0.8]),
            "seed": r.randint(0, 99),
            "stream": r.random() < 0.6,
        }
        if r.random() < 0.5:
            return "/v1/completions", {"prompt": f"Story {r.randint(0, 10**6)}: once upon a time", **common}
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Say something about {r.random()}"}],
            **common,
        }

    def constrained_body(self) -> tuple[str, str, dict]:
        r = self.rng
        kind = r.choice(["json", "regex", "choice", "tool"])
        common = {
            "max_tokens": 64,
            "temperature": r.choice([0, 0.7]),
            "seed": r.randint(0, 99),
            "stream": r.random() < 0.5,
        }
        ask = {
            "json": "Describe a person as JSON.",
            "regex": "Give a phone number.",
            "choice": "Pick a colour.",
            "tool": "What is the weather in Paris?",
        }[kind]
        body = {"messages": [{"role": "user", "content": f"{ask} ({r.randint(0, 10**6)})"}], **common}
        if kind == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        elif kind == "regex":
            body["guided_regex"] = PHONE
        elif kind == "choice":
            body["guided_choice"] = CHOICES
        else:
            body["tools"], body["tool_choice"] = [WEATHER], "required"
        return kind, "/v1/chat/completions", body

    async def one(self, client: httpx.AsyncClient) -> None:
        r, start = self.rng, time.perf_counter()
        row = {"t": start - self.t0, "kind": "ok"}
        try:
            if self.grammars and r.random() < 0.4:
                await self.one_extra(client, row)
            elif r.random() < 0.06:
                row["kind"] = "bad"
                resp = await client.post(
                    "/v1/completions", content=r.choice(BAD_BODIES), headers={"content-type": "application/json"}
                )
                row["status"] = resp.status_code
                row["shape_ok"] = resp.status_code >= 400 and set(resp.json().get("error", {})) >= {"message", "type"}
            elif r.random() < 0.1:  # hang up after a moment, streamed or not
                row["kind"] = "disconnect"
                path, body = self.body()
                try:
                    await asyncio.wait_for(client.post(path, json=body), timeout=r.uniform(0.05, 1.5))
                except TimeoutError:
                    pass
                row["status"] = 0
            else:
                path, body = self.body()
                if body["stream"]:
                    lines = await read_stream(client, path, body, row, start)
                    row["complete"] = bool(lines) and lines[-1] == "data: [DONE]"
                else:
                    resp = await client.post(path, json=body)
                    row["status"] = resp.status_code
                    row["complete"] = resp.status_code == 200 and len(resp.json()["choices"]) == body["n"]
        except Exception as e:
            row["status"], row["error"] = -1, f"{type(e).__name__}: {e}"
        row["latency"] = time.perf_counter() - start
        self.done.append(row)

    async def one_extra(self, client: httpx.AsyncClient, row: dict) -> None:
        """A constrained request (checked), one to an adapter, or a big schema to compile."""
        r = self.rng
        roll = r.random()
        if roll < 0.55:
            kind, path, body = self.constrained_body()
            row["kind"], row["constraint"] = "constrained", kind
            text, calls, finish = await self.send(client, path, body, row)
            row["finish"] = finish
            if row["status"] == 200 and finish in ("stop", "tool_calls"):
                row["valid"] = valid(kind, text, calls)
        elif roll < 0.95:
            names = ["ad0", "ad1", *self.runtime_adapters]
            name = r.choice(names)
            row["kind"], row["adapter"] = "adapter", name
            path, body = self.body()
            body["model"] = name
            await self.send(client, path, body, row)
            # an adapter unloaded meanwhile is a 404 naming it: answered, not lost
            row["complete"] = row["status"] == 200 or (row["status"] == 404 and name.startswith("rt"))
        else:
            row["kind"] = "big_schema"
            tag = r.randint(0, 10**9)
            props = {f"f{tag}_{i}": {"type": "integer"} for i in range(1500)}
            body = {
                "messages": [{"role": "user", "content": "JSON please"}],
                "max_tokens": 8,
                "guided_json": {"type": "object", "properties": props, "required": list(props)},
            }
            resp = await client.post("/v1/chat/completions", json=body)
            row["status"] = resp.status_code
            row["complete"] = resp.status_code == 200 or (resp.status_code == 400 and "compile" in resp.text)

    async def send(self, client: httpx.AsyncClient, path: str, body: dict, row: dict) -> tuple[str, list, str | None]:
        """Send a chat or completion request (streamed or not); its text, tool calls and
        finish reason (choice 0), and whether it came back whole (``row``)."""
        start = time.perf_counter()
        text, calls, finish = "", [], None
        if body.get("stream"):
            tool_args: dict[int, dict] = {}
            async with client.stream("POST", path, json=body) as resp:
                row["status"] = resp.status_code
                every = [ln async for ln in resp.aiter_lines()]
            lines = [ln for ln in every if ln.startswith("data: ")]
            if resp.status_code != 200:
                row["answer"] = "\n".join(every)
            errors = [ln for ln in lines if ln.startswith('data: {"error"')]
            if errors:
                row["answer"] = errors[0]
            row["complete"] = resp.status_code == 200 and bool(lines) and lines[-1] == "data: [DONE]" and not errors
            for ln in lines[:-1] if row["complete"] else []:
                chunk = json.loads(ln[6:])
                for c in chunk.get("choices", []):
                    if c["index"] != 0:
                        continue
                    delta = c.get("delta", {})
                    text += delta.get("content") or c.get("text") or ""
                    for tc in delta.get("tool_calls") or []:
                        slot = tool_args.setdefault(tc["index"], {"function": {"name": "", "arguments": ""}})
                        slot["function"]["name"] += tc.get("function", {}).get("name") or ""
                        slot["function"]["arguments"] += tc.get("function", {}).get("arguments") or ""
                    finish = c.get("finish_reason") or finish
            calls = [tool_args[i] for i in sorted(tool_args)]
        else:
            resp = await client.post(path, json=body)
            row["status"] = resp.status_code
            row["complete"] = resp.status_code == 200
            if resp.status_code != 200:
                row["answer"] = resp.text
            if resp.status_code == 200:
                c = resp.json()["choices"][0]
                msg = c.get("message") or {}
                text, calls, finish = (
                    msg.get("content") or c.get("text") or "",
                    msg.get("tool_calls") or [],
                    c["finish_reason"],
                )
        row["latency"] = time.perf_counter() - start
        return text, calls, finish

    async def adapter_churn(self, client: httpx.AsyncClient) -> None:
        """Load an adapter under a new name every few seconds; unload the oldest beyond two."""
        k = 0
        while time.perf_counter() - self.t0 < self.duration:
            await asyncio.sleep(4)
            name, k = f"rt{k}", k + 1
            resp = await client.post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": self.rng.choice(self.adapter_paths)}
            )
            self.churn.append({"t": time.perf_counter() - self.t0, "op": "load", "status": resp.status_code})
            if resp.status_code == 200:
                self.runtime_adapters.append(name)
            if len(self.runtime_adapters) > 2:
                old = self.runtime_adapters.pop(0)
                resp = await client.post("/v1/unload_lora_adapter", json={"lora_name": old})
                self.churn.append({"t": time.perf_counter() - self.t0, "op": "unload", "status": resp.status_code})

    async def client_loop(self, client: httpx.AsyncClient) -> None:
        while time.perf_counter() - self.t0 < self.duration:
            await self.one(client)


async def run(
    url: str, args: argparse.Namespace, pid: int, grammars: bool = False, adapter_paths: list[str] | None = None
) -> dict:
    soak = Soak(url, args.duration, args.seed, grammars, adapter_paths)
    samples: list[dict] = []

    async def sampler() -> None:
        while True:
            g = await asyncio.to_thread(gauges, url)
            samples.append({"t": time.perf_counter() - soak.t0, "rss_mib": rss_mib(pid), **rss_parts_mib(pid), **g})
            await asyncio.sleep(5)

    sampling = asyncio.create_task(sampler())
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        tasks = [asyncio.create_task(soak.client_loop(client)) for _ in range(args.concurrency)]
        if grammars:
            tasks.append(asyncio.create_task(soak.adapter_churn(client)))
        last = 0
        while not all(t.done() for t in tasks):
            await asyncio.sleep(10)
            elapsed = time.perf_counter() - soak.t0
            if elapsed - last >= 60:
                last = elapsed
                log(f"  {elapsed:.0f} s: {len(soak.done)} requests, RSS {samples[-1]['rss_mib']:.0f} MiB")
        await asyncio.gather(*tasks)
    deadline = time.perf_counter() + 60
    while time.perf_counter() < deadline:  # idle: nothing may be left behind
        g = gauges(url)
        if g.get("num_requests_running") == 0 and g.get("kv_cache_usage_perc") == 0:
            break
        await asyncio.sleep(0.5)
    sampling.cancel()
    final = gauges(url)
    return {"rows": soak.done, "samples": samples, "final": final, "final_rss_mib": rss_mib(pid), "churn": soak.churn}


def summarise(res: dict, duration: float) -> dict:
    rows = res["rows"]
    ok = [r for r in rows if r["kind"] == "ok"]
    bad = [r for r in rows if r["kind"] == "bad"]
    per_minute = {}
    for m in range(int(duration // 60) + 1):
        lat = sorted(r["latency"] for r in ok if m * 60 <= r["t"] < (m + 1) * 60 and r.get("complete"))
        if lat:
            per_minute[m] = {
                "n": len(lat),
                "p50_s": statistics.median(lat),
                "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            }
    rss = [s["rss_mib"] for s in res["samples"]]
    ttft = sorted(r["ttft"] for r in ok if "ttft" in r)
    extra = {}
    if any(r["kind"] in ("constrained", "adapter", "big_schema") for r in rows):
        con = [r for r in rows if r["kind"] == "constrained"]
        ada = [r for r in rows if r["kind"] == "adapter"]
        big = [r for r in rows if r["kind"] == "big_schema"]
        extra = {
            "constrained": len(con),
            "constrained_200_finished": sum(1 for r in con if "valid" in r),
            "constrained_200_valid": sum(1 for r in con if r.get("valid")),
            "constrained_cut_by_length": sum(1 for r in con if r.get("finish") == "length"),
            "constrained_not_whole": sum(1 for r in con if not r.get("complete")),
            "adapter_requests": len(ada),
            "adapter_ok": sum(1 for r in ada if r.get("status") == 200),
            "adapter_gone_404": sum(1 for r in ada if r.get("status") == 404),
            "adapter_not_answered": sum(1 for r in ada if not r.get("complete")),
            "adapter_statuses": dict(Counter(r.get("status") for r in ada)),
            "constrained_statuses": dict(Counter(r.get("status") for r in con)),
            "adapter_other_answers": [r.get("answer", "")[:200] for r in ada if r.get("status") not in (200, 404)][:5],
            "big_schemas": len(big),
            "big_schemas_200": sum(1 for r in big if r.get("status") == 200),
            "big_schemas_400_compile_timeout": sum(1 for r in big if r.get("status") == 400),
            "runtime_loads_200": sum(1 for c in res.get("churn", []) if c["op"] == "load" and c["status"] == 200),
            "runtime_unloads_200": sum(1 for c in res.get("churn", []) if c["op"] == "unload" and c["status"] == 200),
            "runtime_churn_failures": sum(1 for c in res.get("churn", []) if c["status"] != 200),
        }
    return {
        **extra,
        "plain_ttft_n": len(ttft),
        "plain_ttft_p50_s": statistics.median(ttft) if ttft else None,
        "plain_ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
        "requests": len(rows),
        "completed_ok": sum(1 for r in ok if r.get("complete")),
        "incomplete_or_failed": sum(1 for r in ok if not r.get("complete")),
        "status_5xx_or_error": sum(1 for r in rows if r.get("status", 0) >= 500 or r.get("status") == -1),
        "bad_inputs": len(bad),
        "bad_inputs_4xx_in_openai_shape": sum(1 for r in bad if 400 <= r.get("status", 0) < 500 and r.get("shape_ok")),
        "disconnects": sum(1 for r in rows if r["kind"] == "disconnect"),
        "final_gauges": res["final"],
        "rss_mib_first_min": min(rss[: max(1, len(rss) // 10)]) if rss else None,
        "rss_mib_last": rss[-1] if rss else None,
        "rss_mib_max": max(rss) if rss else None,
        **{
            f"{k}_first_last": (res["samples"][0].get(k), res["samples"][-1].get(k))
            for k in ("api_anon_mib", "api_file_mib", "core_anon_mib", "core_file_mib")
            if res["samples"]
        },
        "latency_per_minute": per_minute,
    }


def plot(res: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    s = res["samples"]
    a.plot([x["t"] / 60 for x in s], [x["rss_mib"] for x in s])
    a.set_xlabel("minutes")
    a.set_ylabel("server RSS (MiB)")
    a.set_title("Memory over the soak")
    pm = summary["latency_per_minute"]
    b.plot(list(pm), [v["p99_s"] for v in pm.values()], marker="o", label="p99")
    b.plot(list(pm), [v["p50_s"] for v in pm.values()], marker="o", label="p50")
    b.set_xlabel("minute")
    b.set_ylabel("request latency (s)")
    b.set_title("Latency per minute (completed requests)")
    b.legend()
    c.plot([x["t"] / 60 for x in s], [x.get("num_requests_running", 0) for x in s], label="running")
    c.plot([x["t"] / 60 for x in s], [x.get("num_requests_waiting", 0) for x in s], label="waiting")
    c2 = c.twinx()
    c2.plot([x["t"] / 60 for x in s], [x.get("kv_cache_usage_perc", 0) for x in s], color="grey", alpha=0.6)
    c2.set_ylabel("KV usage (grey)")
    c.set_xlabel("minutes")
    c.set_title("Load")
    c.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--duration",
        type=float,
        default=600,
        help="seconds (of each phase, with --mix grammars; of the abuse phase, with --mix abuse)",
    )
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix", choices=("plain", "grammars", "abuse"), default="plain")
    p.add_argument(
        "--kv-cache-memory", default=None, help="default: 512MiB (plain, abuse), 32MiB (grammars: to preempt)"
    )
    p.add_argument("--name", default=None, help="results/NAME.json and .png (default: soak, soak_grammars, soak_abuse)")
    p.add_argument(
        "--baseline-duration", type=float, default=300, help="--mix abuse: seconds of well-behaved traffic alone"
    )
    p.add_argument(
        "--abuses",
        default="all",
        help="--mix abuse: which, comma separated (default all: emb_10k, "
        "emb_drop, prompts_2k, deep_schema, flood, special_tokens, kill)",
    )
    args = p.parse_args()
    if args.mix == "abuse":
        sys.path.insert(0, str(HERE))
        from soak_abuse import run_abuse

        sys.exit(run_abuse(args, free_port()))
    grammars = args.mix == "grammars"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    kv = args.kv_cache_memory or ("32MiB" if grammars else "512MiB")
    cmd = [
        sys.executable,
        "-m",
        "tokenmill",
        "serve",
        "--port",
        str(port),
        "--kv-cache-memory",
        kv,
        "--max-queue",
        "256",
        "--served-model-name",
        "soak",
    ]
    adapter_paths: list[str] = []
    if grammars:
        import tempfile

        from tokenmill.model.loader import read_config

        _, cfg = read_config(None)
        tmp = Path(tempfile.mkdtemp(prefix="tokenmill-soak-"))
        adapter_paths = [str(write_adapter(tmp / f"a{i}", cfg, rank=8, seed=i)) for i in range(4)]
        cmd += [
            "--enable-lora",
            "--allow-runtime-lora-updating",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            f"ad0={adapter_paths[0]}",
            f"ad1={adapter_paths[1]}",
        ]
    RESULTS.mkdir(exist_ok=True)
    name = args.name or ("soak_grammars" if grammars else "soak")
    server_log = open(RESULTS / f"{name}_server.log", "w")
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=server_log, text=True)
    phases: dict[str, dict] = {}
    try:
        wait_healthy(url)
        log(f"soak: {args.duration:.0f} s, {args.concurrency} clients against {url} ({' '.join(cmd[3:])})")
        if grammars:
            log("phase 1: the plain mix alone (baseline)")
            phases["plain"] = asyncio.run(run(url, args, server.pid))
            log("phase 2: the plain mix with constrained, adapter and big-schema requests, adapters loaded meanwhile")
            phases["mixed"] = asyncio.run(run(url, args, server.pid, grammars=True, adapter_paths=adapter_paths))
        else:
            phases["plain"] = asyncio.run(run(url, args, server.pid))
        preemptions = next(
            (
                float(ln.rsplit(" ", 1)[1])
                for ln in httpx.get(url + "/metrics").text.splitlines()
                if ln.startswith("tokenmill:num_preemptions_total")
            ),
            None,
        )
    finally:
        server.terminate()
        code = server.wait(60)
        server_log.close()
    summaries = {k: summarise(v, args.duration) for k, v in phases.items()}
    result: dict = {
        "command": " ".join(sys.argv),
        "server_command": " ".join(cmd[1:]),
        "server_exit_code": code,
        "preemptions_total": preemptions,
    }
    sys.path.insert(0, str(HERE))
    from step_overhead import cpu_info

    if grammars:
        base, mixed = summaries["plain"]["plain_ttft_p99_s"], summaries["mixed"]["plain_ttft_p99_s"]
        result["plain_ttft_p99_ratio_mixed_over_plain"] = mixed / base if base and mixed else None
        result["summary"] = summaries
        samples = phases["plain"]["samples"] + [{**x, "t": x["t"] + args.duration} for x in phases["mixed"]["samples"]]
    else:
        result["summary"] = summaries["plain"]
        samples = phases["plain"]["samples"]
    (RESULTS / f"{name}.json").write_text(json.dumps({"cpu": cpu_info(), **result, "samples": samples}, indent=1))
    plot({"samples": samples}, summaries["mixed" if grammars else "plain"], RESULTS / f"{name}.png")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
