"""Models named by their Hub id, end to end through the `tokenmill` command and the real huggingface_hub
client, against a stand-in for the Hub's HTTP API on 127.0.0.1 (``HF_ENDPOINT``): never the network.

The repos are made here: a tiny safetensors Llama (with the files a real repo carries that must not be
fetched), a tiny GGUF repo with two quant tags (one split in parts), a model of a family tokenmill does
not serve, a gated one."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers import gguf_tokenizer_metadata, make_tiny_llama, write_adapter, write_tiny_llama_gguf
from tests.hub_standin import GOOD_TOKEN, HubStandIn
from tokenmill.loadgen.server_process import free_port
from tokenmill.model.hf_export import write_tokenizer
from tokenmill.model.paths import default_model_path
from tokenmill.model.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

LLAMA = "tiny-org/tiny-llama"
GGUF = "tiny-org/Tiny-GGUF"
BERT = "tiny-org/tiny-bert"
GATED = "tiny-org/gated-llama"
ADAPTER = "tiny-org/tiny-llama-lora"
BIG = "tiny-org/too-big"
VOCAB = len(gguf_tokenizer_metadata(default_model_path())["tokenizer.ggml.tokens"])


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, Path]:
    """The repos' files on disk: a safetensors folder of >10 MB (one download chunk of the client
    and more, so that a cut can be resumed), and a folder of GGUF files."""
    root = tmp_path_factory.mktemp("repos")
    torch.manual_seed(0)
    llama = root / "llama"
    hf_llama = make_tiny_llama(llama, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    write_tokenizer(llama, load_tokenizer(default_model_path()), 256)
    write_adapter(root / "adapter", hf_llama, rank=4)
    ggufs = root / "gguf"
    ggufs.mkdir()
    write_tiny_llama_gguf(ggufs / "Tiny-Q8_0.gguf", "Q8_0")
    write_tiny_llama_gguf(ggufs / "Tiny-Q4_0.gguf", "Q4_0", split_max_tensors=10)
    assert len(list(ggufs.glob("Tiny-Q4_0-0000?-of-00003.gguf"))) == 3
    return {"llama": llama, "gguf": ggufs, "adapter": root / "adapter"}


@pytest.fixture()
def hub(repos):
    """A fresh stand-in with every repo (the GGUF repo with a model card and a projector that are
    no model; the llama with PyTorch and ONNX copies that must not be downloaded)."""
    standin = HubStandIn()
    llama = {str(p.relative_to(repos["llama"])): p for p in repos["llama"].iterdir()}
    extras = {"pytorch_model.bin": b"pickle", "onnx/model.onnx": b"onnx", "README.md": b"# tiny"}
    standin.add_commit(LLAMA, llama | extras)
    standin.add_commit(
        GGUF, {p.name: p for p in repos["gguf"].iterdir()} | {"README.md": b"# tiny", "mmproj-F16.gguf": b"GGUF"}
    )
    standin.add_commit(
        BERT,
        {
            "config.json": json.dumps({"model_type": "bert", "architectures": ["BertModel"]}).encode(),
            "model.safetensors": b"x" * 64,
        },
    )
    standin.add_folder(ADAPTER, repos["adapter"])
    standin.add_commit(GATED, llama, gated=True)
    standin.add_commit(BIG, llama)
    standin.repos[BIG].sizes["model.safetensors"] = 1 << 50  # the Hub lists a petabyte
    standin.start()
    yield standin
    standin.stop()


def tokenmill(*args: str, hub: HubStandIn | None, home: Path, **env: str) -> subprocess.CompletedProcess:
    """The command with the Hub at the stand-in (or at a port nobody listens on) and its cache in ``home``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environ |= {
        "HF_HOME": str(home),
        "HF_ENDPOINT": hub.endpoint if hub is not None else f"http://127.0.0.1:{free_port()}",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", "tokenmill", *args], capture_output=True, text=True, env=environ, timeout=300
    )


def downloads(hub: HubStandIn) -> list[str]:
    """The files the client fetched (GET of a file, not the HEAD that checks it)."""
    return [
        r["path"].split("/resolve/", 1)[1].split("/", 1)[1]
        for r in hub.requests
        if r["method"] == "GET" and "/resolve/" in r["path"]
    ]


def generated(*args: str, **kw) -> str:
    r = tokenmill("generate", "The capital of France is", "--max-tokens", "6", "--dtype", "float32", *args, **kw)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_pull_fetches_only_the_files_the_model_needs_and_serves_it_by_id(hub, repos, tmp_path):
    r = tokenmill("pull", LLAMA, hub=hub, home=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    path = Path(lines[-1])
    assert lines[0].startswith(f"{LLAMA} (safetensors, revision main, commit ") and "MiB" in lines[0]
    assert "Fetching" in r.stderr  # the client's progress bars
    assert path.is_dir() and path.is_relative_to(tmp_path / "hub")
    assert sorted(downloads(hub)) == sorted(p.name for p in repos["llama"].iterdir())  # no .bin, ONNX or README
    hub.requests.clear()
    by_id = generated("--model", LLAMA, hub=hub, home=tmp_path)
    assert hub.requests == []  # cached: started with no request at all
    assert by_id == generated("--model", str(repos["llama"]), hub=None, home=tmp_path)


def test_gguf_tags_pick_the_file_and_a_split_model_loads_from_its_parts(hub, repos, tmp_path):
    r = tokenmill("pull", f"hf.co/{GGUF}:q4_0", hub=hub, home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(downloads(hub)) == [f"Tiny-Q4_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert Path(r.stdout.strip().splitlines()[-1]).name == "Tiny-Q4_0-00001-of-00003.gguf"
    split = generated("--model", f"{GGUF}:Q4_0", hub=hub, home=tmp_path)
    assert split == generated("--model", str(repos["gguf"] / "Tiny-Q4_0-00001-of-00003.gguf"), hub=None, home=tmp_path)
    missing = tokenmill("pull", f"{GGUF}:Q5_K_M", hub=hub, home=tmp_path)
    assert missing.returncode == 2
    assert "has no Q5_K_M GGUF; its tags: Q4_0, Q8_0" in missing.stderr and "Traceback" not in missing.stderr
    untagged = tokenmill("pull", GGUF, hub=hub, home=tmp_path)  # no Q4_K_M here: the tags to choose from
    assert untagged.returncode == 2 and "no Q4_K_M GGUF, the default" in untagged.stderr and "Q8_0" in untagged.stderr


def test_a_cut_download_resumes_where_it_stopped(hub, repos, tmp_path):
    weights = (repos["llama"] / "model.safetensors").read_bytes()
    assert len(weights) > 11 << 20
    hub.cut["model.safetensors"] = (10 << 20) + 12345  # the connection drops past the client's first 10 MiB chunk
    r = tokenmill("pull", LLAMA, hub=hub, home=tmp_path)
    assert r.returncode == 0, r.stderr
    ranges = [q["range"] for q in hub.requests if q["method"] == "GET" and q["path"].endswith("model.safetensors")]
    assert ranges == [None, f"bytes={10 << 20}-"]  # the second request asks for the rest only
    got = Path(r.stdout.strip().splitlines()[-1]) / "model.safetensors"
    assert hashlib.sha256(got.read_bytes()).digest() == hashlib.sha256(weights).digest()


def test_revisions_are_pinned_and_a_cached_branch_moves_only_on_pull(hub, repos, tmp_path):
    first = hub.repos[LLAMA].refs["main"]
    hub.repos[LLAMA].refs["v1"] = first
    assert tokenmill("pull", LLAMA, hub=hub, home=tmp_path).returncode == 0
    files = {str(p.relative_to(repos["llama"])): p for p in repos["llama"].iterdir()}
    second = hub.add_commit(LLAMA, files | {"generation_config.json": b'{"temperature": 0.5}'})
    hub.requests.clear()
    started = tokenmill("pull", LLAMA, "--revision", "v1", hub=hub, home=tmp_path)
    assert f"commit {first[:12]}" in started.stdout
    cached = generated("--model", LLAMA, hub=hub, home=tmp_path)  # main as cached: no request, the old commit
    assert not any(q["path"].startswith("/api") and "revision/main" in q["path"] for q in hub.requests)
    updated = tokenmill("pull", LLAMA, hub=hub, home=tmp_path)
    assert updated.returncode == 0 and f"commit {second[:12]}" in updated.stdout
    assert json.loads((Path(updated.stdout.splitlines()[-1]) / "generation_config.json").read_text()) == {
        "temperature": 0.5
    }
    pinned = tokenmill("pull", LLAMA, "--revision", first, hub=hub, home=tmp_path)
    assert pinned.returncode == 0 and Path(pinned.stdout.splitlines()[-1]).name == first
    assert cached == generated("--model", LLAMA, "--revision", "v1", hub=None, home=tmp_path)  # offline, by tag
    nope = tokenmill("pull", LLAMA, "--revision", "v9", hub=hub, home=tmp_path)
    assert nope.returncode == 2 and f"{LLAMA} has no revision 'v9'" in nope.stderr


def test_offline_starts_from_the_cache_and_says_what_to_do_when_it_cannot(hub, repos, tmp_path):
    assert tokenmill("pull", f"{GGUF}:Q8_0", hub=hub, home=tmp_path).returncode == 0
    hub.stop()  # no Hub at all from here
    assert generated("--model", f"{GGUF}:Q8_0", hub=None, home=tmp_path, HF_HUB_OFFLINE="1")
    assert generated("--model", f"{GGUF}:q8_0", hub=None, home=tmp_path)
    # no tag means what it means online (Q4_K_M, which this repo lacks), not "whatever quant is cached"
    untagged = tokenmill("generate", "Hi", "--model", GGUF, hub=None, home=tmp_path, HF_HUB_OFFLINE="1")
    assert untagged.returncode == 2 and "is not in the Hub cache" in untagged.stderr
    unreachable = tokenmill("generate", "Hi", "--model", LLAMA, hub=None, home=tmp_path)
    assert unreachable.returncode == 2 and "Traceback" not in unreachable.stderr
    assert "cannot reach the Hub" in unreachable.stderr and "tokenmill pull tiny-org/tiny-llama" in unreachable.stderr
    assert "HF_HUB_OFFLINE" in unreachable.stderr
    offline = tokenmill("pull", LLAMA, hub=None, home=tmp_path, HF_HUB_OFFLINE="1")
    assert offline.returncode == 2 and "HF_HUB_OFFLINE=1 forbids downloading" in offline.stderr


def test_list_shows_each_cached_model_and_rm_frees_it(hub, tmp_path):
    empty = tokenmill("list", hub=hub, home=tmp_path)
    assert empty.returncode == 0 and "no models in the Hub cache" in empty.stdout
    for model in (LLAMA, f"{GGUF}:Q8_0", f"{GGUF}:Q4_0"):
        assert tokenmill("pull", model, hub=hub, home=tmp_path).returncode == 0
    fetched = subprocess.run(  # a model of a family tokenmill does not serve, in the cache by another tool
        [sys.executable, "-c", f"import huggingface_hub as h; h.snapshot_download({BERT!r})"],
        env={**os.environ, "HF_HOME": str(tmp_path), "HF_ENDPOINT": hub.endpoint},
        capture_output=True,
    )
    assert fetched.returncode == 0, fetched.stderr
    rows = [re.split(r"\s{2,}", line) for line in tokenmill("list", hub=hub, home=tmp_path).stdout.splitlines()]
    assert rows[0] == ["MODEL", "REVISION", "TYPE", "SIZE", "SERVES"]
    table = {(r[0], r[2]): r[3:] for r in rows[1:]}
    assert table[(LLAMA, "safetensors")][1] == "yes" and rows[1][1] == "main"
    assert table[(GGUF, "gguf Q8_0")][1] == "yes" and table[(GGUF, "gguf Q4_0")][1] == "yes"
    mib = {tag: float(table[(GGUF, f"gguf {tag}")][0].split()[0]) for tag in ("Q8_0", "Q4_0")}
    assert mib["Q8_0"] > mib["Q4_0"] > 4  # each quant its own size
    assert table[(BERT, "safetensors")][1] == "no: model_type bert"
    before = sum(f.stat().st_size for f in (tmp_path / "hub").rglob("*") if f.is_file())
    r = tokenmill("rm", GGUF, hub=hub, home=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith(f"removed {GGUF} (1 revision): 13.")
    after = sum(f.stat().st_size for f in (tmp_path / "hub").rglob("*") if f.is_file())
    assert before - after > 13 << 20
    assert GGUF not in tokenmill("list", hub=hub, home=tmp_path).stdout
    again = tokenmill("rm", GGUF, hub=hub, home=tmp_path)
    assert again.returncode == 2 and "not in the Hub cache" in again.stderr


@pytest.mark.parametrize(
    "model, env, said",
    [
        ("tiny-org/no-such-model", {}, "no model tiny-org/no-such-model on the Hub"),
        (BERT, {}, "tiny-org/tiny-bert is a BertModel (model_type 'bert'), a family tokenmill does not serve"),
        (BIG, {}, "needs 1048576.00 GiB to download"),
        (GATED, {}, "tiny-org/gated-llama is gated: accept its terms"),
        (GATED, {"HF_TOKEN": "hf_wrong"}, "you are not in the authorized list"),
        ("not/a/repo/id", {}, "is not a Hugging Face repo id"),
    ],
)
def test_a_model_that_cannot_be_pulled_is_one_clear_line_before_any_download(hub, tmp_path, model, env, said):
    r = tokenmill("pull", model, hub=hub, home=tmp_path, **env)
    assert r.returncode == 2, r.stdout
    assert said in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not [f for f in downloads(hub) if f.endswith(".safetensors")]


def test_a_gated_model_downloads_with_a_token(hub, tmp_path):
    r = tokenmill("pull", GATED, hub=hub, home=tmp_path, HF_TOKEN=GOOD_TOKEN)
    assert r.returncode == 0, r.stderr
    assert any(q["authorization"] == f"Bearer {GOOD_TOKEN}" for q in hub.requests)


def test_serve_takes_the_id_as_vllm_does_and_names_the_model_by_it(hub, tmp_path):
    """`tokenmill serve ORG/NAME` (the positional vLLM takes), a LoRA adapter by its id too; both
    downloaded before the server starts and served under the ids the user gave."""
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environ |= {"HF_HOME": str(tmp_path), "HF_ENDPOINT": hub.endpoint, "PYTHONUNBUFFERED": "1"}
    flags = ["--port", str(port), "--kv-cache-memory", "64MiB", "--dtype", "float32", "--enable-lora"]
    cmd = [sys.executable, "-m", "tokenmill", "serve", LLAMA, *flags, "--lora-modules", f"ad={ADAPTER}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert sorted(m["id"] for m in httpx.get(url + "/v1/models").json()["data"]) == ["ad", LLAMA]
        texts = {}
        for model in (LLAMA, "ad"):
            body = {"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            texts[model] = reply.json()["choices"][0]["text"]
        assert texts["ad"] != texts[LLAMA]  # the adapter downloaded by its id is applied
    finally:
        proc.terminate()
        proc.wait(30)
