"""Test helpers shared by the test modules (never imported from one test module into another)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager

import torch

from tokenmill.configuration.config import ModelConfig
from tokenmill.model.chat_template import render_chat_template
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.tokenizer import open_final_message
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.inputs import SeqInput


def seq(token_ids, block_table, num_computed=0, request_id="r", sample=True) -> SeqInput:
    return SeqInput(
        request_id=request_id,
        token_ids=list(token_ids),
        num_computed_tokens=num_computed,
        block_table=list(block_table),
        sample=sample,
        params=SamplingParams(),
        prompt_ids=[],
        output_ids=[],
    )


@torch.inference_mode()
def all_logits(runner, seqs) -> torch.Tensor:
    """Logits at every new position of the batch (not only the sampled ones)."""
    return runner.all_logits(seqs)


def fused_and_python_decode_logits(llm, texts=None) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
    """Decode logits of one sequence and of three together, with the model's C++ layer loop
    (True) and with the Python loop (False), after the same prefills (of three short prompts,
    or of ``texts``)."""
    model, runner, pool = llm.parts.model, llm.engine.core.runner, llm.engine.core.block_pool
    texts = texts or ("The capital of France is", "def f(x):", "Once upon a time, a fox")
    prompts = [llm.tokenizer.encode(p) for p in texts]
    block_size = llm.engine.core.config.block_size
    tables = [pool.allocate((len(ids) + 2 + block_size - 1) // block_size) for ids in prompts]
    try:
        for ids, blocks in zip(prompts, tables, strict=True):
            all_logits(runner, [seq(ids, blocks)])  # prefill (more tokens than the loop takes: Python)
        results = {}
        for fused in (True, False):
            model._fused_plan = False if fused else None  # None: the Python loop
            one = all_logits(runner, [seq([42], tables[0], num_computed=len(prompts[0]))])
            three = all_logits(
                runner,
                [
                    seq([7 + i], blocks, num_computed=len(ids) + 1)
                    for i, (ids, blocks) in enumerate(zip(prompts, tables, strict=True))
                ],
            )
            results[fused] = (one, three)
        return results
    finally:
        model._fused_plan = False
        for blocks in tables:
            pool.free(blocks)


def run_to_completion(engine, prompts=None, params=None) -> dict:
    """Add prompts (if given) and step until nothing is left; request id -> final output."""
    if prompts is not None:
        params = params if isinstance(params, list) else [params] * len(prompts)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll until predicate() is true or the deadline passes (instead of a fixed sleep)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# ----------------------------------------------------------------- toy engine parts

TOY_VOCAB = 50


class ToyTokenizer:
    """Characters in, letters out: enough for the engine's text handling."""

    stop_token_ids: frozenset[int] = frozenset()

    def __init__(self, vocab: int = TOY_VOCAB) -> None:
        self.vocab_size = vocab

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + (
            "assistant: " if add_generation_prompt else ""
        )

    def encode_chat(
        self,
        messages,
        add_generation_prompt=True,
        tools=None,
        allow_special_tokens=False,
        template_kwargs=None,
        continue_final_message=False,
        chat_template=None,
        add_special_tokens=False,
        render=None,
    ):
        """The real Tokenizer.encode_chat's keywords (the server passes whichever a request
        sets): a request's template rendered as the real one renders it, the final message
        left open as the real one leaves it; the toy has no special tokens to add."""
        if chat_template is not None:
            variables = {
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                **(template_kwargs or {}),
            }
            text = (render or render_chat_template)(chat_template, variables)
        else:
            text = self.apply_chat_template(messages, add_generation_prompt)
        if continue_final_message:
            text = open_final_message(text, messages[-1])
        return self.encode(text, add_special_tokens)


def next_token(history: list[int]) -> int:
    """The scripted model: the next token is a function of all tokens so far."""
    return (sum(history) * 31 + len(history)) % TOY_VOCAB


def propose(history: list[int], k: int) -> list[int]:
    """Scripted drafts: right before a position that depends on the history, wrong from it
    (so some are accepted in full, some in part, some not at all)."""
    right = sum(history) % (k + 1)
    drafts: list[int] = []
    for i in range(k):
        t = next_token(history + drafts)
        drafts.append(t if i < right else (t + 1) % TOY_VOCAB)
    return drafts


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    out: list[int] = []
    for _ in range(max_tokens):
        out.append(next_token(prompt + out))
    return out


class ScriptedRunner:
    """A model runner that keeps the persistent per-request state the real one keeps,
    from the same deltas, and checks every step against it: the scheduled tokens must
    be known, the block table long enough (lookahead included), the drafts the ones it
    proposed. It 'samples' ``next_token`` and verifies drafts greedily against it."""

    def __init__(self, block_size: int, lookahead: int = 0, logprob: float | None = None) -> None:
        self.block_size = block_size
        self.lookahead = lookahead  # slots a model proposer would write past the tokens
        self.logprob = logprob  # what a request asking for logprobs is told of each token it samples
        self.batches: list = []
        self.requests: dict[str, dict] = {}
        self.parked: set[str] = set()

    def execute(self, batch, grammar=None):  # grammar masks: a scripted runner samples no logits
        from tokenmill.engine.model_input import ModelOutput, SampledToken

        self.batches.append(batch)
        for rid in batch.finished_request_ids:
            self.requests.pop(rid, None)
            self.parked.discard(rid)
        for rid in batch.preempted_request_ids:
            assert self.requests.pop(rid, None) is not None, f"{rid} preempted but not held"
            self.parked.add(rid)
        for new in batch.new_requests:
            self.parked.discard(new.request_id)
            self.requests[new.request_id] = {
                "tokens": list(new.prompt_token_ids) + list(new.output_token_ids),
                "blocks": list(new.block_ids),
                "draft": [],
                "params": new.params,
                "pooling": new.pooling,
                "prompt_len": len(new.prompt_token_ids),
            }
        for c in batch.cached_requests:
            table = self.requests[c.request_id]["blocks"]
            assert c.num_kept_blocks <= len(table)
            del table[c.num_kept_blocks :]
            table.extend(c.new_block_ids)
        out = ModelOutput()
        for s in batch.scheduled:
            state = self.requests[s.request_id]
            k = len(s.spec_token_ids)
            assert state["draft"][:k] == s.spec_token_ids, "scheduled drafts differ from the proposed ones"
            end = s.num_computed_tokens + s.num_tokens - k
            assert end <= len(state["tokens"]), "scheduled past the known tokens"
            samples = end == len(state["tokens"])
            self._prompt_work(s.request_id, state, s.num_computed_tokens, end, out)
            if state["pooling"] is not None:
                samples = False  # an embedding request samples nothing
            need = s.num_computed_tokens + s.num_tokens + (self.lookahead and s.num_lookahead)
            assert len(state["blocks"]) * self.block_size >= need, "block table too short"
            assert len(set(state["blocks"])) == len(state["blocks"]), "a block twice in one table"
            if not samples:
                continue
            history = state["tokens"]
            kept = []
            for d in s.spec_token_ids:
                if d != self.choose(state, history + kept):
                    break
                kept.append(d)
            kept.append(self.choose(state, history + kept))
            logprob = self.logprob if state["params"].logprobs is not None else None
            out.sampled[s.request_id] = [SampledToken(t, logprob) for t in kept]
            if s.num_lookahead:
                out.draft_token_ids[s.request_id] = propose(history + kept, s.num_lookahead)
        for s in batch.scheduled:  # commit
            if s.request_id in out.sampled:
                self.requests[s.request_id]["tokens"].extend(t.token_id for t in out.sampled[s.request_id])
            self.requests[s.request_id]["draft"] = out.draft_token_ids.get(s.request_id, [])
        return out

    def choose(self, state: dict, history: list[int]) -> int:
        """The token the scripted model samples after ``history`` (a subclass may script it)."""
        return next_token(history)

    @staticmethod
    def _prompt_work(rid: str, state: dict, start: int, end: int, out) -> None:
        """Prompt logprobs and embeddings, as the real runner reports them: the scripted
        model gives its next token logprob 0 (rank 1) and any other -10 (rank 2); an
        embedding is [1, 0] once the prompt is done."""
        p, prompt = state["params"], state["tokens"][: state["prompt_len"]]
        if p.prompt_logprobs is not None and start + 1 < len(prompt):
            scores = []
            for j in range(start + 1, min(end, len(prompt) - 1) + 1):
                best = next_token(prompt[:j])
                top = [(best, 0.0)] if p.prompt_logprobs else []
                scores.append((0.0, 1, top) if prompt[j] == best else (-10.0, 2, top))
            out.prompt_logprobs[rid] = (start + 1, scores)
        if state["pooling"] is not None and end == len(prompt):
            out.embeddings[rid] = [1.0, 0.0]


def make_tiny_llama(path, **overrides):
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    cfg.update(overrides)
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    model.save_pretrained(path)
    return model


def tiny_model(seed: int, vocab: int = 8, layers: int = 2) -> LlamaForCausalLM:
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    w = {
        "embed_tokens.weight": rand(vocab, 32, std=1.0),
        "norm.weight": torch.ones(32),
        "lm_head.weight": rand(vocab, 32, std=0.35),
    }
    for i in range(layers):
        p = f"layers.{i}."
        w |= {p + "input_layernorm.weight": torch.ones(32), p + "post_attention_layernorm.weight": torch.ones(32)}
        w |= {p + f"self_attn.{n}_proj.weight": rand(32 if n in "qo" else 16, 32) for n in "qkvo"}
        w |= {p + "mlp.gate_proj.weight": rand(64, 32), p + "mlp.up_proj.weight": rand(64, 32)}
        w[p + "mlp.down_proj.weight"] = rand(32, 64)
    return LlamaForCausalLM.from_weights(cfg, w)


# ----------------------------------------------------------------------- LoRA

LORA_TARGET_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
ALL_LORA_TARGETS = tuple(LORA_TARGET_MODULES)


def write_adapter(path, hf_model, targets=ALL_LORA_TARGETS, rank=4, alpha=8, seed=0, rslora=False, **config):
    """A PEFT adapter folder with random A and B (B non-zero, unlike a fresh PEFT init)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, layer in enumerate(hf_model.model.layers):
        for t in targets:
            lin = getattr(getattr(layer, LORA_TARGET_MODULES[t]), t)
            prefix = f"base_model.model.model.layers.{i}.{LORA_TARGET_MODULES[t]}.{t}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, lin.in_features, generator=g) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(lin.out_features, rank, generator=g) * 0.3
    path.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, str(path / "adapter_model.safetensors"))
    conf = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "target_modules": list(targets),
        "bias": "none",
        **config,
    }
    (path / "adapter_config.json").write_text(json.dumps(conf))
    return path


def make_tiny_chat_model(path, tokenizer, vocab_size: int, chat_template: str | None = None, **overrides):
    """A tiny random Llama with the given tokenizer (and chat template), saved as a HF folder."""
    model = make_tiny_llama(
        path, **{"vocab_size": vocab_size, "max_position_embeddings": 1024, "num_hidden_layers": 2, **overrides}
    )
    tokenizer.backend.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", **({"chat_template": chat_template} if chat_template else {})}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return model


# ------------------------------------------------------------------- model families

_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
}  # (the last two: Phi-3)


def gguf_tokenizer_metadata(gguf_path) -> dict:
    """The ``tokenizer.*`` keys of a GGUF file."""
    from tokenmill.model.gguf_file import read_gguf

    metadata, _ = read_gguf(gguf_path)
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}


_GGUF_TOKENIZER_WRITERS = {
    "tokenizer.ggml.model": "add_tokenizer_model",
    "tokenizer.ggml.pre": "add_tokenizer_pre",
    "tokenizer.ggml.tokens": "add_token_list",
    "tokenizer.ggml.merges": "add_token_merges",
    "tokenizer.ggml.scores": "add_token_scores",
    "tokenizer.ggml.token_type": "add_token_types",
    "tokenizer.ggml.bos_token_id": "add_bos_token_id",
    "tokenizer.ggml.eos_token_id": "add_eos_token_id",
    "tokenizer.ggml.unknown_token_id": "add_unk_token_id",
    "tokenizer.ggml.add_bos_token": "add_add_bos_token",
    "tokenizer.ggml.add_eos_token": "add_add_eos_token",
    "tokenizer.ggml.add_space_prefix": "add_add_space_prefix",
    "tokenizer.chat_template": "add_chat_template",
}


def random_gguf_blocks(type_name: str, n: int, k: int, seed: int = 0):
    """[n, k] weights as random GGUF blocks of ``type_name`` (any bits) with small float16
    scales: for the K-quants, which gguf-py can read but not write."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    scale_at = {
        "Q8_0": [0],
        "Q4_0": [0],
        "Q5_0": [0],
        "Q4_1": [0, 2],
        "Q5_1": [0, 2],
        "Q4_K": [0, 2],
        "Q5_K": [0, 2],
        "Q6_K": [208],
    }[type_name]
    small = 0.002 if type_name.endswith("_K") else 0.02  # K-quants multiply by 6/8-bit sub-scales too
    for pos in scale_at:
        d = rng.uniform(-small, small, size=raw.shape[:2]).astype(np.float16)
        raw[..., pos : pos + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)


def write_gguf(
    path, hf_model, arch: str, tokenizer: dict, weight_type: str | None = None, split_max_tensors: int = 0
) -> None:
    """A HF model as an F32 GGUF, as llama.cpp's converter writes it (Q/K rows permuted
    for llama-arch files), with the given ``tokenizer.*`` metadata. ``weight_type`` stores
    the 2-D weights quantised (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 with gguf-py's quantiser; the
    K-quants as random blocks, since gguf-py has no quantiser for them). ``split_max_tensors``: split
    into parts of at most that many tensors, named as llama.cpp's gguf-split names them
    (``NAME-00001-of-0000N.gguf`` beside ``path``)."""
    import gguf
    import numpy as np

    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if "full_attention" in rope:  # Gemma 3: global layers' RoPE (with its scaling), local layers' base
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        rope = rope["full_attention"]
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_freq_base(getattr(cfg, "rope_theta", None) or rope["rope_theta"])
    if getattr(cfg, "num_local_experts", None):
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    for key, value in tokenizer.items():
        if key in _GGUF_TOKENIZER_WRITERS:
            getattr(w, _GGUF_TOKENIZER_WRITERS[key])(value)

    def permute(t, heads):  # llama.cpp's LlamaModel.permute
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    gemma = arch.startswith("gemma")
    layer_names = _GGUF_LAYER | (
        {
            "post_attention_layernorm": "post_attention_norm",
            "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm",
        }
        if gemma
        else {}
    )
    if gemma:  # what llama.cpp's converter writes for Gemma 2/3
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        if getattr(cfg, "attn_logit_softcapping", None):
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if getattr(cfg, "final_logit_softcapping", None):
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    for name, t in hf_model.state_dict().items():
        t = t.float().numpy()
        name = name.removeprefix("model.")
        if gemma and name.endswith("norm.weight"):
            t = t + 1  # llama.cpp stores Gemma's norms as the 1 + w they multiply by
        if name == "embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out = "output.weight"
        elif name.endswith("mlp.experts.gate_up_proj"):  # Mixtral's stacked experts: [E, 2I, H]
            i = name.split(".")[1]
            w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(t[:, : t.shape[1] // 2]))
            w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(t[:, t.shape[1] // 2 :]))
            continue
        elif name.endswith("mlp.experts.down_proj"):
            out = f"blk.{name.split('.')[1]}.ffn_down_exps.weight"
        elif name.endswith("mlp.gate.weight") and getattr(cfg, "num_local_experts", None):
            out = f"blk.{name.split('.')[1]}.ffn_gate_inp.weight"
        else:
            _, i, rest = name.split(".", 2)
            module, kind = rest.rsplit(".", 1)
            if arch == "llama" and module == "self_attn.q_proj":
                t = permute(t, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                t = permute(t, cfg.num_key_value_heads)
            out = f"blk.{i}.{layer_names[module]}.{kind}"
        t = np.ascontiguousarray(t, dtype=np.float32)
        if weight_type is not None and t.ndim == 2:
            qtype = gguf.GGMLQuantizationType[weight_type]
            if weight_type in ("F16", "BF16"):
                w.add_tensor(
                    out,
                    t.astype(np.float16) if weight_type == "F16" else gguf.quants.quantize(t, qtype),
                    raw_dtype=None if weight_type == "F16" else qtype,
                )
            elif weight_type.endswith("_K"):
                w.add_tensor(out, random_gguf_blocks(weight_type, *t.shape, seed=len(out)), raw_dtype=qtype)
            else:
                w.add_tensor(out, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
            continue
        w.add_tensor(out, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_llama_gguf(path, weight_type: str, split_max_tensors: int = 0) -> None:
    """A tiny random Llama (64 wide, 2 layers) with the default model's tokenizer, as a GGUF of
    ``weight_type`` (split in parts of ``split_max_tensors`` tensors if given); the same weights
    at every call."""
    import transformers

    from tokenmill.model.paths import default_model_path

    tokenizer = gguf_tokenizer_metadata(default_model_path())
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tokenizer["tokenizer.ggml.tokens"]),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    write_gguf(path, model, "llama", tokenizer, weight_type, split_max_tensors=split_max_tensors)


# ------------------------------------------------------------------- processes


def run_on_avx2_build(checks: str) -> None:
    """Run ``checks`` (Python, from the repository root) in a fresh interpreter whose native
    kernels are the -march=haswell build: AVX2, FMA and F16C only, what an AVX2-only CPU
    runs. Fails with the child's stderr unless the checks complete. Where the build is not
    in torch's cache yet, the child must say that it compiles, then how long it took (issue
    43: minutes of silence on first start); where it is, it must say neither."""
    code = (
        "import sys, torch\n"
        "sys.path.insert(0, '.')\n"
        "from tokenmill.kernels.native import build_name, load_native\n"
        "assert 'haswell' in build_name() and load_native(), build_name()\n" + checks + "\nprint('ok')\n"
    )
    env = dict(os.environ, TOKENMILL_MARCH="haswell")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cached = subprocess.run(
        [sys.executable, "-c", "from tokenmill.kernels.native import _built, build_name; print(_built(build_name()))"],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.strip()
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    said = "compiling the native CPU kernels" in r.stderr and "native CPU kernels built in" in r.stderr
    assert said == (cached == "False"), (cached, r.stderr[-3000:])


def child_pids(pid: int) -> list[int]:
    """The live children of a process (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def engine_core_pid(server_pid: int) -> int:
    """The engine-core process of a `tokenmill serve` (its child started by
    multiprocessing's spawn, not spawn's resource tracker)."""
    for pid in child_pids(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            return pid
    raise AssertionError(f"process {server_pid} has no engine-core child")


def loads_torch(pid: int) -> bool:
    """True when the process has torch's library mapped (Linux /proc)."""
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def process_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


# A model shape small enough for adapter files written in a test (no weights needed).
LORA_CFG = ModelConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


def tiny_adapter(path, conf=None, a=None, b=None):
    """A PEFT adapter folder for LORA_CFG: q_proj of layer 0, rank 2."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    a = torch.randn(2, 16) if a is None else a
    b = torch.randn(16, 2) if b is None else b
    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b,
        },
        str(path / "adapter_model.safetensors"),
    )
    conf = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]} if conf is None else conf
    (path / "adapter_config.json").write_text(conf if isinstance(conf, str) else json.dumps(conf))
    return path


# ------------------------------------------------------- speculative sampling


def exact_first_tokens(model, prompt, temperature, top_k=0, block=4):
    """P(t1) and P(t2, t3) of the target's own sampling, by enumeration."""
    vocab = model.config.vocab_size
    from tokenmill.worker.kv_allocation import allocate_kv_cache
    from tokenmill.worker.model_runner import ModelRunner

    cpu = torch.device("cpu")
    runner = ModelRunner(model, allocate_kv_cache(model.config, 16, block, torch.float32, cpu), block, cpu)

    def probs(tokens):
        logits = all_logits(runner, [seq(tokens, list(range(16)))])[-1].double() / temperature
        if top_k:
            logits[logits < logits.topk(top_k).values[-1]] = -torch.inf
        return logits.softmax(-1)

    p1 = probs(prompt)
    p23 = torch.zeros(vocab, vocab, dtype=torch.float64)
    for t1 in range(vocab):
        p2 = probs(prompt + [t1])
        for t2 in range(vocab):
            p23[t2] += p1[t1] * p2[t2] * probs(prompt + [t1, t2])
    return p1, p23.flatten()


def chi_square_pvalue(counts, expected: torch.Tensor) -> float:
    """Chi-square p-value of observed token counts against exact probabilities (cells
    expected under 5 pooled)."""
    import pytest

    stats = pytest.importorskip("scipy.stats")
    n = sum(counts.values())
    exp = (expected / expected.sum() * n).tolist()
    obs = [counts[i] for i in range(len(exp))]
    assert all(o == 0 for o, e in zip(obs, exp, strict=True) if e == 0), "a token the target never samples"
    big = [i for i, e in enumerate(exp) if e >= 5]
    rare = [i for i, e in enumerate(exp) if 0 < e < 5]  # pooled into one cell
    f_obs, f_exp = [obs[i] for i in big], [exp[i] for i in big]
    if rare:
        f_obs.append(sum(obs[i] for i in rare))
        f_exp.append(sum(exp[i] for i in rare))
    f_exp[-1] += n - sum(f_exp)  # exact totals, as chisquare demands
    return stats.chisquare(f_obs, f_exp).pvalue


# ----------------------------------------------------------------- a real browser (the web page's tests)

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def chromium_paths() -> tuple[str, str] | None:
    """(browser, chromedriver) of the system Chromium, or None: $TOKENMILL_CHROMIUM and
    $TOKENMILL_CHROMEDRIVER first, else the PATH (apt-get install chromium chromium-driver)."""
    browser = os.environ.get("TOKENMILL_CHROMIUM") or next(filter(None, map(shutil.which, BROWSERS)), None)
    driver = os.environ.get("TOKENMILL_CHROMEDRIVER") or shutil.which("chromedriver")
    if browser and driver and os.access(browser, os.X_OK) and os.access(driver, os.X_OK):
        return browser, driver
    return None


@contextmanager
def browser(width: int = 1280, height: int = 860):
    """A headless Chromium (selenium's webdriver.Chrome) with a width x height window, quit
    at the end. The driver is given its path, so Selenium Manager never downloads one;
    the console is kept (``console_errors``)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    paths = chromium_paths()
    if paths is None:
        raise RuntimeError("no Chromium: apt-get install chromium chromium-driver (or set TOKENMILL_CHROMIUM)")
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--disable-extensions",
        "--no-first-run",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=paths[1]), options=options)
    try:
        set_viewport(driver, width, height)
        yield driver
    finally:
        driver.quit()


def set_viewport(driver, width: int, height: int, mobile: bool = False) -> None:
    """Make the page's viewport exactly width x height CSS pixels (a headless window has a
    500-pixel minimum width, and its toolbar takes some of its height). ``mobile``: as a
    phone would (the page's meta viewport honoured, overlay scrollbars)."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile},
    )


def console_errors(driver) -> list[str]:
    """The console's errors (level SEVERE) since the last call (reading the log empties it)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


# ----------------------------------------------------------------- a Qwen3-like vocabulary

# Qwen3's chat template, as published in its tokenizer_config.json (tools, reasoning of the
# current turn, and the empty think block that enable_thinking=false writes into the prompt).
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
QWEN3_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>")  # added whole, not special (as Qwen's)


def write_qwen3_tokenizer(folder):
    """A Qwen3-like tokenizer folder (tokenizer.json, tokenizer_config.json): SmolLM2's
    byte-level BPE (its <|im_start|> and <|im_end|> special) with Qwen's thinking and tool
    tags added, and Qwen3's chat template; its Tokenizer."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from tokenmill.model.paths import default_model_path
    from tokenmill.model.tokenizer import load_tokenizer, tokenizer_from_folder

    backend = HFTokenizer.from_str(load_tokenizer(default_model_path()).backend.to_str())
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_ADDED])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {"chat_template": QWEN3_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer_from_folder(folder)
