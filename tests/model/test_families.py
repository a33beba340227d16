"""Model families beyond Llama, as switches of one decoder: Qwen2 (q/k/v biases),
Qwen3 (per-head q/k RMSNorm), Mistral (its own model type; a sliding window), Phi-3
(projections fused in the checkpoint; LongRoPE).

Each family is a tiny random checkpoint built here with transformers' own classes,
saved as a Hugging Face folder (with SmolLM2's tokenizer) and converted to GGUF; both
load and give transformers' logits (float32, 1e-4) for a prefill and 16 decode steps
through the paged cache, and the same greedy tokens batched as alone.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import gguf_tokenizer_metadata, make_tiny_chat_model, seq, write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelLoadError

transformers = pytest.importorskip("transformers")

COMMON = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "tie_word_embeddings": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None, "head_dim": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": None, "pad_token_id": None}),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"sliding_window": None, "num_local_experts": 6, "num_experts_per_tok": 2, "head_dim": 8},
    ),
    # windows shorter than the prompts, alternating with global layers; soft-capping on (Gemma 2)
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 6,
            "num_hidden_layers": 4,
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 6,
            "num_hidden_layers": 4,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": 16,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        },
    ),
}
# Mistral's and Mixtral's GGUFs say llama
HF_TYPE = {"gemma3": "gemma3_text"}
GGUF_ARCH = {
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mistral": "llama",
    "phi3": "phi3",
    "mixtral": "llama",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, llm):
    name = request.param
    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(vocab_size=llm.config.vocab_size, **(COMMON | extra))
    ref = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # transformers starts biases at 0 and norms at 1: make them count
        for pname, p in ref.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in pname:
                p.normal_(1, 0.3)
    folder = tmp_path_factory.mktemp(name)
    make_tiny_chat_model(folder, llm.tokenizer, llm.config.vocab_size)  # the tokenizer files
    ref.save_pretrained(folder)
    gguf = folder.parent / f"{name}.gguf"
    write_gguf(gguf, ref, GGUF_ARCH[name], gguf_tokenizer_metadata(llm.model_path))
    return name, ref, folder, gguf


def _prefill_and_decode(llm: LLM, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Logits at every prompt position, then one decode step at a time (greedy) through
    the paged cache: [len(prompt) + steps, vocab], and the tokens it chose."""
    tokens = list(prompt)
    bs = llm.engine.core.block_size
    with llm.engine.core.borrow_blocks(-(-(len(prompt) + steps) // bs)) as blocks:
        rows = [llm.parts.runner.all_logits([seq(tokens, blocks)])]
        for _ in range(steps):
            tokens.append(int(rows[-1][-1].argmax()))
            rows.append(llm.parts.runner.all_logits([seq(tokens[-1:], blocks, num_computed=len(tokens) - 1)]))
    return tokens, torch.cat(rows)


@pytest.mark.parametrize("fmt", ["folder", "gguf"])
def test_family_matches_transformers(family, fmt):
    name, ref, folder, gguf = family
    with LLM(str(folder if fmt == "folder" else gguf), dtype="float32", progress=False, kv_cache_memory="32MiB") as llm:
        expected_arch = {"folder": HF_TYPE.get(name, name), "gguf": GGUF_ARCH[name]}[fmt]
        assert llm.config.architecture == expected_arch
        prompt = llm.tokenizer.encode("Tiny models of every family, one decoder: ")
        tokens, ours = _prefill_and_decode(llm, prompt, 16)
        with torch.no_grad():
            expected = ref(torch.tensor([tokens[:-1]])).logits[0]
        torch.testing.assert_close(ours[:-1], expected, atol=1e-4, rtol=0)


def test_family_batched_equals_alone(family):
    """Float32: a batch gives each sequence exactly its tokens alone. int8 weights load
    and run for every family (their kernels round activations to bfloat16 and differ by
    batch size, so they are not held to identity on random weights' near-ties)."""
    name, _, folder, _ = family
    prompts = ["The quick brown fox", "Once upon a time, in a land", "1 2 3 4 5", "def f(x):"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(str(folder), dtype="float32", progress=False, kv_cache_memory="32MiB") as llm:
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    with LLM(str(folder), dtype="float32", progress=False, kv_cache_memory="32MiB", quantization="int8") as llm:
        assert all(len(o.outputs[0].token_ids) == 12 for o in llm.generate(prompts, params))


def test_unknown_architecture_is_refused_naming_what_is_supported(tmp_path, llm):
    make_tiny_chat_model(tmp_path, llm.tokenizer, llm.config.vocab_size)
    config = (tmp_path / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "gpt_neox"')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(
        ModelLoadError,
        match=r"unsupported model_type 'gpt_neox'.*supported: gemma2, gemma3_text, llama, mistral, mixtral, phi3, qwen2, qwen3",
    ):
        LLM(str(tmp_path), progress=False)


def test_sliding_window_matches_transformers_and_frees_blocks(tmp_path, llm):
    """Mistral with a 24-token window and a prompt of ~100 tokens: transformers' logits
    through prefill (in chunks) and decode, and the blocks that left the window are back
    in the pool while the request still runs."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=llm.config.vocab_size, sliding_window=24, head_dim=8, **COMMON)
    ref = transformers.MistralForCausalLM(cfg).eval()
    make_tiny_chat_model(tmp_path, llm.tokenizer, llm.config.vocab_size)
    ref.save_pretrained(tmp_path)
    prompt = llm.tokenizer.encode("A long prompt, longer than the attention window of this tiny model. " * 8)
    assert len(prompt) > 4 * 24
    for kernels in ("native", "torch"):
        with LLM(
            str(tmp_path),
            dtype="float32",
            progress=False,
            kv_cache_memory="32MiB",
            kernels=kernels,
            max_num_batched_tokens=40,
        ) as ours:
            tokens, logits = _prefill_and_decode(ours, prompt, 8)
            with torch.no_grad():
                expected = ref(torch.tensor([tokens[:-1]])).logits[0]
            torch.testing.assert_close(logits[:-1], expected, atol=1e-4, rtol=0)
            # through the engine: chunked prefill, then decode, blocks given back as it goes
            engine = ours.engine
            (req,) = engine.add_request("w", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
                if req.num_computed_tokens > 48 and not req.finished:
                    held = len(req.block_ids) - req.num_freed_blocks
                    assert req.num_freed_blocks > 0 and held <= -(-(24 + 40) // 16) + 1
                    assert engine.core.block_pool.num_used == held
            assert req.output_token_ids == tokens[len(prompt) :]
            assert engine.core.block_pool.num_free == engine.core.block_pool.num_blocks


def test_phi3_longrope_matches_transformers(tmp_path, llm):
    """LongRoPE's short factors and attention factor, within the original context (where
    transformers and we both use the short factors; beyond it, transformers switches a
    whole sequence to the long factors and we switch per position, as vLLM does)."""
    torch.manual_seed(0)
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.3 * i for i in range(4)],
        "long_factor": [2.0 + 0.5 * i for i in range(4)],
    }
    cfg = transformers.Phi3Config(
        vocab_size=llm.config.vocab_size,
        sliding_window=None,
        pad_token_id=None,
        original_max_position_embeddings=64,
        rope_scaling=rope,
        **COMMON,
    )
    ref = transformers.Phi3ForCausalLM(cfg).eval()
    make_tiny_chat_model(tmp_path, llm.tokenizer, llm.config.vocab_size)
    ref.save_pretrained(tmp_path)
    with LLM(str(tmp_path), dtype="float32", progress=False, kv_cache_memory="32MiB") as ours:
        assert ours.config.rope_scaling.rope_type == "longrope" and ours.config.rope_scaling.attention_factor > 1
        prompt = ours.tokenizer.encode("Phi-3 with LongRoPE, inside its original context.")
        tokens, logits = _prefill_and_decode(ours, prompt, 16)
        assert len(tokens) < 64
        with torch.no_grad():
            expected = ref(torch.tensor([tokens[:-1]])).logits[0]
        torch.testing.assert_close(logits[:-1], expected, atol=1e-4, rtol=0)


def test_family_tensor_parallel(family):
    """TP=2 of each family: Qwen2's q/k/v biases cut with their rows, Qwen3's per-head
    norms replicated, Phi-3's pre-fused projections, Mixtral's experts cut by columns."""
    name, _, folder, _ = family
    if name == "mistral":
        pytest.skip("Llama's shape: covered by tests/model/test_parallel.py")
    prompts = ["The quick brown fox", "Once upon a time, in a land"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    opts = dict(dtype="float32", progress=False, kv_cache_memory="32MiB")
    with LLM(str(folder), **opts) as whole:
        prompt = whole.tokenizer.encode(prompts[0])
        _, expected_logits = _prefill_and_decode(whole, prompt, 4)
        expected = [o.outputs[0].token_ids for o in whole.generate(prompts, params)]
    with LLM(str(folder), tensor_parallel_size=2, **opts) as split:
        _, logits = _prefill_and_decode(split, prompt, 4)
        torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=0)
        assert [o.outputs[0].token_ids for o in split.generate(prompts, params)] == expected


@pytest.mark.parametrize("damage", ["missing", "shape"])
def test_a_checkpoint_that_does_not_fit_is_refused_naming_the_tensor(family, tmp_path, damage):
    """A family's checkpoint with a tensor removed, or one of the wrong shape."""
    import shutil

    from safetensors.torch import load_file, save_file

    name, _, folder, _ = family
    if name not in ("qwen3", "mixtral"):
        pytest.skip("one dense and one mixture-of-experts family are enough")
    broken = tmp_path / name
    shutil.copytree(folder, broken)
    weights = load_file(str(broken / "model.safetensors"))
    victim = next(k for k in weights if k.startswith("model.layers.1.") and ("q_norm" in k or "experts.2.w3" in k))
    if damage == "missing":
        del weights[victim]
    else:
        weights[victim] = torch.zeros(3, 5)
    save_file(weights, str(broken / "model.safetensors"))
    short = victim.removeprefix("model.")
    expected = short if damage == "missing" or name != "mixtral" else "the experts of layers.1"
    with pytest.raises(ModelLoadError, match=r"checkpoint does not fit the model") as err:
        LLM(str(broken), progress=False)
    assert expected in str(err.value)


def test_family_through_every_engine_feature(family):
    """Chunked prefill (a 24-token budget), shared prefixes (prefix caching), a pool too
    small for all (preemption), n=2 and prompt-lookup speculation: token-identical to a
    plain run; draft-model speculation (the model drafting for itself) likewise. Then int4
    weights with an fp8 KV cache, and int8 KV, run."""
    name, _, folder, _ = family
    prefix = "Shared system prompt for every request of this test: be brief, be exact, and answer in English. " * 2
    prompts = [prefix + p for p in ("The quick brown fox", "Once upon a time", "1 2 3 4 5 6 7 8")]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, n=2)
    opts = dict(dtype="float32", progress=False)
    with LLM(str(folder), kv_cache_memory="32MiB", **opts) as plain:
        expected = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, params)]
        block_bytes = plain.parts.kv_bytes_per_block
    with LLM(
        str(folder),
        kv_cache_memory=f"{10 * block_bytes}B",
        max_num_batched_tokens=24,
        speculative="ngram",
        spec_disable_batch_size=8,
        **opts,
    ) as busy:
        assert [[c.token_ids for c in o.outputs] for o in busy.generate(prompts, params)] == expected
        assert busy.engine.core.num_preemptions > 0 and busy.engine.core.prefix_cache_stats.hits > 0
        assert busy.engine.core.block_pool.num_free == busy.engine.core.block_pool.num_blocks
    with LLM(
        str(folder),
        kv_cache_memory="32MiB",
        speculative="draft",
        draft_model=str(folder),
        spec_disable_batch_size=8,
        **opts,
    ) as drafted:  # the model drafting for itself: every draft accepted
        assert [[c.token_ids for c in o.outputs] for o in drafted.generate(prompts, params)] == expected
        stats = drafted.engine.core.spec_decode_stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    small = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for quant, kv in (("int4", "fp8"), ("none", "int8")):
        with LLM(
            str(folder),
            kv_cache_memory="32MiB",
            quantization=quant,
            quantization_group_size=32,
            kv_cache_dtype=kv,
            **opts,
        ) as llm:
            assert all(len(o.outputs[0].token_ids) == 8 for o in llm.generate(prompts, small))
