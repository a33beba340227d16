"""Multi-LoRA over HTTP: adapters as models, listed with their parent, loaded and
unloaded while requests run, bad adapters and unknown names refused, metrics."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.helpers import make_tiny_chat_model, write_adapter
from tests.server.conftest import MODEL, Server
from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def setup(tmp_path_factory, llm):
    root = tmp_path_factory.mktemp("lora_server")
    hf = make_tiny_chat_model(root / "base", llm.tokenizer, llm.config.vocab_size)
    adapters = {"alpha": write_adapter(root / "alpha", hf, seed=11), "beta": write_adapter(root / "beta", hf, seed=12,
                targets=("q_proj", "v_proj"), rank=8, alpha=16), "gamma": write_adapter(root / "gamma", hf, seed=13)}  # fmt: skip
    bad = write_adapter(root / "bad", hf, seed=14, rank=64)  # above --max-lora-rank
    server = Server("--model", str(root / "base"), "--kv-cache-memory", "16MiB", "--enable-lora", "--max-lora-rank", "8",
                    "--lora-modules", f"alpha={adapters['alpha']}", f"beta={adapters['beta']}",
                    "--allow-runtime-lora-updating")  # fmt: skip
    offline = LLM(str(root / "base"), dtype="float32", progress=False, enable_lora=True, max_lora_rank=8,
                  kv_cache_memory="16MiB", lora_modules=[f"{k}={v}" for k, v in adapters.items()])  # fmt: skip
    yield server, adapters, bad, offline
    server.stop()


def complete(server, model, prompt="The river ran", max_tokens=8, **extra):
    return httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                            "temperature": 0, **extra}, timeout=60)  # fmt: skip


def test_adapters_are_models_with_a_parent_and_match_offline(setup):
    server, adapters, _, offline = setup
    cards = {c["id"]: c for c in httpx.get(server.url + "/v1/models").json()["data"]}
    assert set(cards) == {MODEL, "alpha", "beta"}
    assert cards["alpha"]["parent"] == MODEL and cards[MODEL]["parent"] is None
    for model, lora in ((MODEL, None), ("alpha", "alpha"), ("beta", "beta")):
        r = complete(server, model)
        assert r.status_code == 200 and r.json()["model"] == model
        ids = offline.tokenizer.encode("The river ran")
        expected = offline.generate(ids, SamplingParams(temperature=0, max_tokens=8), lora=lora)[0].outputs[0].text
        assert r.json()["choices"][0]["text"] == expected, model
    r = complete(server, "nope")
    assert r.status_code == 404 and "alpha" in r.json()["error"]["message"]


def test_load_and_unload_while_a_request_runs(setup):
    server, adapters, bad, offline = setup
    result = {}

    def long_request():
        result["r"] = complete(server, "alpha", prompt="Once upon a time", max_tokens=200, ignore_eos=True)

    t = threading.Thread(target=long_request)
    t.start()
    load = {"lora_name": "gamma", "lora_path": str(adapters["gamma"])}
    assert httpx.post(server.url + "/v1/load_lora_adapter", json=load, timeout=60).status_code == 200
    r = complete(server, "gamma")
    ids = offline.tokenizer.encode("The river ran")
    assert r.json()["choices"][0]["text"] == offline.generate(ids, SamplingParams(temperature=0, max_tokens=8),
                                                              lora="gamma")[0].outputs[0].text  # fmt: skip
    assert httpx.post(server.url + "/v1/load_lora_adapter", json=load).status_code == 400  # already served
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and "max-lora-rank" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "none", "lora_path": "/nonexistent"})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "alpha"}).status_code == 200
    assert complete(server, "alpha").status_code == 404  # new requests: gone
    t.join(120)
    assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 200  # it finished
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "alpha"}).status_code == 404
    metrics = httpx.get(server.url + "/metrics").text
    info = next(line for line in metrics.splitlines() if line.startswith("tokenmill:lora_requests_info{"))
    assert 'max_lora="4"' in info
    counts = [line for line in metrics.splitlines() if line.startswith("tokenmill:lora_requests_total{")]
    assert any('lora_name="gamma"' in line and line.endswith(" 1.0") for line in counts), counts
    assert complete(server, MODEL).status_code == 200


def test_runtime_updates_are_off_unless_allowed(setup):
    server, adapters, _, _ = setup
    plain = Server("--model", server_model_dir(adapters), "--kv-cache-memory", "16MiB", "--enable-lora")
    try:
        r = httpx.post(plain.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters["beta"])})
        assert r.status_code == 404
    finally:
        plain.stop()


def server_model_dir(adapters) -> str:
    return str(next(iter(adapters.values())).parent / "base")
