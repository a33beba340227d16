"""The server on another family: a tiny Gemma 3 GGUF (local and global layers, q/k norms,
its own chat template from the file) answers chat completions, streamed and not."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.helpers import gguf_tokenizer_metadata, write_gguf
from tests.server.conftest import MODEL, Server
from tokenmill.model.paths import default_model_path

transformers = pytest.importorskip("transformers")


def test_gemma3_gguf_serves_chat(tmp_path):
    tokenizer = gguf_tokenizer_metadata(default_model_path())
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer["tokenizer.ggml.tokens"]),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        sliding_window_pattern=2,
        max_position_embeddings=512,
    )
    path = tmp_path / "gemma3.gguf"
    write_gguf(path, transformers.Gemma3ForCausalLM(cfg).eval(), "gemma3", tokenizer)
    server = Server("--model", str(path))
    try:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        message = reply.json()["choices"][0]["message"]["content"]
        assert reply.json()["usage"]["completion_tokens"] == 12
        streamed = []
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed.extend(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
        assert "".join(streamed) == message
    finally:
        assert server.stop() == 0
