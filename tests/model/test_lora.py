"""Multi-LoRA: adapters written in PEFT's format by the tests (random, non-zero A and B)
on a tiny random Llama with SmolLM2's vocabulary, checked against the same model with
the adapter merged into its weights (W + s B A), ours and transformers'."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers import ALL_LORA_TARGETS as ALL
from tests.helpers import make_tiny_chat_model, write_adapter
from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError, TokenmillError

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

PROMPTS = ["The river ran", "Once upon a time", "def add(a, b):", "The river ran fast over"]


def merged(hf_model, adapter_dir):
    """A copy of the transformers model with the adapter merged: W + s B A."""
    conf = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = conf["lora_alpha"] / (math.sqrt(conf["r"]) if conf.get("use_rslora") else conf["r"])
    tensors = safetensors_torch.load_file(str(adapter_dir / "adapter_model.safetensors"))
    model = transformers.LlamaForCausalLM(hf_model.config).eval()
    model.load_state_dict(hf_model.state_dict())
    with torch.no_grad():
        for name, module in model.named_modules():
            key = f"base_model.model.{name}.lora_A.weight"
            if key in tensors:
                module.weight += scale * tensors[key.replace("lora_A", "lora_B")] @ tensors[key]
    return model


@pytest.fixture(scope="module")
def base(tmp_path_factory, llm):
    path = tmp_path_factory.mktemp("lora_base")
    return path, make_tiny_chat_model(path, llm.tokenizer, llm.config.vocab_size)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    path, hf = base
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": write_adapter(root / "all", hf, seed=1),
        "attn": write_adapter(root / "attn", hf, targets=("q_proj", "v_proj"), rank=8, alpha=16, seed=2),
        "mlp": write_adapter(
            root / "mlp", hf, targets=("gate_proj", "up_proj", "down_proj"), rank=2, alpha=4, seed=3, rslora=True
        ),
    }


def served(base, adapters, **kw):
    mods = [f"{name}={p}" for name, p in adapters.items()]
    kw = {"kv_cache_memory": "16MiB", **kw}
    return LLM(str(base[0]), dtype="float32", progress=False, enable_lora=True, lora_modules=mods, **kw)


def ids(llm, text):
    return llm.tokenizer.encode(text)


def test_logits_match_transformers_with_the_adapter_merged(base, adapters):
    path, hf = base
    ours = served(base, adapters, max_lora_rank=8)
    for name, adapter_dir in adapters.items():
        ref = merged(hf, adapter_dir)
        prompt = ids(ours, PROMPTS[0])
        out = ours.generate(prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=5), lora=name)[0].outputs[0]
        full = torch.tensor([prompt + out.token_ids[:-1]])
        with torch.no_grad():
            ref_lp = ref(full).logits[0, len(prompt) - 1 :].log_softmax(-1)
        assert out.token_ids == ref_lp.argmax(-1).tolist(), name  # greedy identical
        for pos, top in enumerate(out.top_logprobs):
            for token, lp in top:
                assert abs(lp - ref_lp[pos, token].item()) < 1e-4, (name, pos)
    base_only = ours.generate(ids(ours, PROMPTS[0]), SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    with torch.no_grad():
        plain = hf.generate(torch.tensor([ids(ours, PROMPTS[0])]), max_new_tokens=8, do_sample=False)[0].tolist()
    assert base_only.token_ids == plain[len(ids(ours, PROMPTS[0])) :]  # no adapter: the base model


def test_a_mixed_batch_gives_each_request_its_output_alone(base, adapters):
    llm = served(base, adapters, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=12)
    loras = [None, "all", "attn", "mlp", "all", None, "mlp", "attn", "mlp"]
    prompts = [ids(llm, PROMPTS[i % len(PROMPTS)]) for i in range(len(loras) - 1)]
    prompts.append(ids(llm, " ".join(PROMPTS * 4)))  # a long prompt: its slot is computed on its own
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora=loras)]
    alone = [llm.generate(p, params, lora=a)[0].outputs[0].token_ids for p, a in zip(prompts, loras, strict=True)]
    assert together == alone
    assert len({tuple(t) for t in together[:4]}) == 4  # the adapters do change the output


def test_prefix_cache_is_keyed_by_adapter(base, adapters):
    llm = served(base, adapters, max_lora_rank=8)
    prompt = ids(llm, " ".join(["a long shared prompt"] * 12))
    params = SamplingParams(temperature=0, max_tokens=2)
    assert llm.generate(prompt, params, lora="all")[0].num_cached_tokens == 0
    assert llm.generate(prompt, params, lora="attn")[0].num_cached_tokens == 0  # never another adapter's blocks
    assert llm.generate(prompt, params)[0].num_cached_tokens == 0  # nor the base model's
    assert llm.generate(prompt, params, lora="all")[0].num_cached_tokens > 0  # the same adapter shares
    assert llm.generate(prompt, params)[0].num_cached_tokens > 0


def test_max_loras_preemption_speculation_and_a_small_cpu_cache(base, adapters):
    reference = served(base, adapters, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=40)
    loras = ["all", "attn", "mlp", None, "mlp", "attn", "all", "mlp"]
    prompts = [ids(reference, PROMPTS[i % len(PROMPTS)] + " and the mill turned") for i in range(len(loras))]
    expected = [
        reference.generate(p, params, lora=a)[0].outputs[0].token_ids for p, a in zip(prompts, loras, strict=True)
    ]
    # one adapter slot, two adapters in memory (the third is read again from disk), a cache too small for all
    tight = served(
        base,
        adapters,
        max_lora_rank=8,
        max_loras=1,
        max_cpu_loras=2,
        kv_cache_memory="24KiB",
        speculative="ngram",
        spec_disable_batch_size=64,
    )
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, lora=loras)]
    assert got == expected
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert tight.spec_decode_stats.num_drafts > 0
    pool = tight.engine.core.block_pool
    assert pool.num_free == pool.num_blocks


def test_load_and_unload_at_runtime(base, adapters):
    llm = served(base, {"all": adapters["all"]}, max_lora_rank=8)
    prompt = ids(llm, PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=6)
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'mlp'"):
        llm.generate(prompt, params, lora="mlp")
    llm.load_lora("mlp", str(adapters["mlp"]))
    first = llm.generate(prompt, params, lora="mlp")[0].outputs[0].token_ids
    assert first == served(base, adapters, max_lora_rank=8).generate(prompt, params, lora="mlp")[0].outputs[0].token_ids
    llm.unload_lora("mlp")
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter"):
        llm.generate(prompt, params, lora="mlp")


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ("rank", "above --max-lora-rank"),
        ("dora", "DoRA"),
        ("lm_head", "lm_head"),
        ("bias", "biases"),
        ("shape", "expected A"),
        ("missing", "no loadable adapter at this path"),
        ("unpaired", "without its pair"),
    ],
)
def test_bad_adapters_are_refused_naming_the_problem(base, tmp_path, change, needle):
    path, hf = base
    kwargs = {"rank": 32} if change == "rank" else {}
    extra = {"use_dora": True} if change == "dora" else {"bias": "all"} if change == "bias" else {}
    targets = ("q_proj", "lm_head") if change == "lm_head" else ALL
    if change == "lm_head":
        adapter = write_adapter(tmp_path / "a", hf, targets=("q_proj",))
        conf = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**conf, "target_modules": list(targets)}))
    else:
        adapter = write_adapter(tmp_path / "a", hf, **kwargs, **extra)
    if change in ("shape", "unpaired", "missing"):
        tensors = safetensors_torch.load_file(str(adapter / "adapter_model.safetensors"))
        key = next(k for k in tensors if "lora_A" in k)
        if change == "shape":
            tensors[key] = torch.randn(4, 7)
        elif change == "unpaired":
            del tensors[key.replace("lora_A", "lora_B")]
        safetensors_torch.save_file(tensors, str(adapter / "adapter_model.safetensors"))
        if change == "missing":
            (adapter / "adapter_model.safetensors").unlink()
    small = {"dtype": "float32", "progress": False, "enable_lora": True, "kv_cache_memory": "16MiB"}
    with pytest.raises(TokenmillError, match=needle):
        LLM(str(path), lora_modules=[f"bad={adapter}"], **small)
    llm = LLM(str(path), **small)
    with pytest.raises(TokenmillError, match=needle):
        llm.load_lora("bad", str(adapter))
    assert llm.generate("hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # the engine serves on


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_adapters_on_quantised_base_weights(base, adapters, quantization):
    llm = served(base, adapters, max_lora_rank=8, quantization=quantization, quantization_group_size=32)
    params = SamplingParams(temperature=0, max_tokens=10)
    loras = [None, "all", "attn", "mlp"]
    prompts = [ids(llm, p) for p in PROMPTS]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora=loras)]
    alone = [llm.generate(p, params, lora=a)[0].outputs[0].token_ids for p, a in zip(prompts, loras, strict=True)]
    assert together == alone
    plain = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    assert together[1:] != plain[1:]  # the adapters apply on top of the quantised weights


def test_structured_output_with_an_adapter(base, adapters):
    llm = served(base, adapters, max_lora_rank=8)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured={"json": schema})
    outs = llm.generate([ids(llm, p) for p in PROMPTS], params, lora=["all", "attn", None, "mlp"])
    for o in outs:
        assert o.outputs[0].finish_reason == "stop" and set(json.loads(o.outputs[0].text)) == {"n"}


def test_lora_root_fences_the_paths_adapters_load_from(base, tmp_path):
    """Issue 24 item 8: with --lora-root, an adapter outside it is refused (at start and
    at run time) before anything is read; one inside loads."""
    path, hf = base
    inside = write_adapter(tmp_path / "root" / "a", hf)
    outside = write_adapter(tmp_path / "b", hf)
    small = {
        "dtype": "float32",
        "progress": False,
        "enable_lora": True,
        "kv_cache_memory": "16MiB",
        "lora_root": str(tmp_path / "root"),
    }
    with pytest.raises(TokenmillError, match="--lora-root"):
        LLM(str(path), lora_modules=[f"out={outside}"], **small)
    llm = LLM(str(path), lora_modules=[f"in={inside}"], **small)
    with pytest.raises(TokenmillError, match="--lora-root"):
        llm.load_lora("out", str(outside))
    assert llm.generate("hi", SamplingParams(max_tokens=2), lora="in")[0].outputs[0].token_ids
