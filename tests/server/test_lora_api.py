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
    adapters = {
        "alpha": write_adapter(root / "alpha", hf, seed=11),
        "beta": write_adapter(root / "beta", hf, seed=12, targets=("q_proj", "v_proj"), rank=8, alpha=16),
        "gamma": write_adapter(root / "gamma", hf, seed=13),
    }
    bad = write_adapter(root / "bad", hf, seed=14, rank=64)  # above --max-lora-rank
    server = Server(
        "--model",
        str(root / "base"),
        "--kv-cache-memory",
        "16MiB",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"alpha={adapters['alpha']}",
        f"beta={adapters['beta']}",
        "--allow-runtime-lora-updating",
    )
    offline = LLM(
        str(root / "base"),
        dtype="float32",
        progress=False,
        enable_lora=True,
        max_lora_rank=8,
        kv_cache_memory="16MiB",
        lora_modules=[f"{k}={v}" for k, v in adapters.items()],
    )
    yield server, adapters, bad, offline
    server.stop()


def complete(server, model, prompt="The river ran", max_tokens=8, **extra):
    return httpx.post(
        server.url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra},
        timeout=60,
    )


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
    assert (
        r.json()["choices"][0]["text"]
        == offline.generate(ids, SamplingParams(temperature=0, max_tokens=8), lora="gamma")[0].outputs[0].text
    )
    assert httpx.post(server.url + "/v1/load_lora_adapter", json=load).status_code == 400  # already served
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and "max-lora-rank" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "none", "lora_path": "/nonexistent"})
    assert r.status_code == 400 and "no loadable adapter at this path" in r.json()["error"]["message"]
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


def test_bad_adapter_folders_are_400s_in_openai_shape(setup, tmp_path):
    """Issue 24 items 4 and 6: what used to be a plain-text 500 (or an adapter answering
    '' with stop) is a 400 in OpenAI's error shape, and the server goes on serving."""
    import shutil

    from safetensors.torch import load_file, save_file

    server, adapters, _, _ = setup

    def copy(name: str, conf_text: str | None = None, nan: bool = False):
        path = shutil.copytree(adapters["alpha"], tmp_path / name)
        if conf_text is not None:
            (path / "adapter_config.json").write_text(conf_text)
        if nan:
            tensors = load_file(str(path / "adapter_model.safetensors"))
            key = next(iter(tensors))
            tensors[key][0, 0] = float("nan")
            save_file(tensors, str(path / "adapter_model.safetensors"))
        return str(path)

    conf = (adapters["alpha"] / "adapter_config.json").read_text()
    cases = {
        "alpha-null": copy("a1", conf.replace('"lora_alpha": 8', '"lora_alpha": null')),
        "a-list": copy("a2", "[1, 2]"),
        "deep": copy("a3", "[" * 100_000 + "]" * 100_000),
        "nan-weights": copy("a4", nan=True),
        "alpha-nan": copy("a5", conf.replace('"lora_alpha": 8', '"lora_alpha": NaN')),
        "long-path": str(tmp_path / ("x" * 300)),
    }
    for name, path in cases.items():
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=60)
        assert r.status_code == 400, (name, r.status_code, r.text[:200])
        assert r.json()["error"]["type"] == "BadRequestError" and r.json()["error"]["code"] == 400, name
    assert complete(server, MODEL).status_code == 200
    assert not {c["id"] for c in httpx.get(server.url + "/v1/models").json()["data"]} & set(cases)


def test_concurrent_loads_of_one_name_serve_it_once(setup):
    """Issue 24 item 5: of four loads of one new name at once, one is served (200) and
    the others are told it already is (400), whichever wins."""
    server, adapters, _, _ = setup
    results: list[httpx.Response] = []

    def load():
        body = {"lora_name": "delta", "lora_path": str(adapters["gamma"])}
        results.append(httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=60))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(r.status_code for r in results) == [200, 400, 400, 400]
    assert all("already served" in r.json()["error"]["message"] for r in results if r.status_code == 400)
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "delta"}).status_code == 200


@pytest.mark.parametrize("name", ["bad\nname", "\u202eevil", "../../etc", " ", "a/b", "x" * 200])
def test_adapter_names_outside_a_safe_set_are_refused(setup, name):
    """Issue 24 item 10: adapter names are letters, digits, '.', '_' and '-' (a letter or
    digit first, at most 128): nothing that reads as a path, a control or a direction mark."""
    server, adapters, _, _ = setup
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapters["gamma"])})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
