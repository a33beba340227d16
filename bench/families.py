"""Model families (issue 16): what each family's switches cost on the shared decoder.

    python bench/families.py [--layers 12]

All in one run, with the CPU recorded: a random model of each family at one size
(hidden 512, 8 query heads of 64, 2 KV heads, MLP 1536, SmolLM2's 49152-token
vocabulary and tokenizer; Mixtral: 8 experts of 1536, 2 per token; windowed families:
a 128-token window, shorter than the prompts; every one with tied embeddings), saved as
a Hugging Face folder, and for
each: load time (``LLM(...)``), single-stream decode (one 256-token prompt, 64 new
tokens) and batched throughput (16 prompts of 256, 32 new tokens each), medians of
three runs, relative to the
Llama of the same size measured just before it (the machine drifts over a run: each
family is paired with its own Llama measurement). Writes bench/results/families.json
and families.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu import cpu_info

RESULTS = Path(__file__).parent / "results"
WINDOW = 128


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def families(layers: int) -> dict[str, tuple[str, str, dict]]:
    common = dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        vocab_size=49152,
        tie_word_embeddings=True,
    )
    return {
        "llama": ("LlamaConfig", "LlamaForCausalLM", common),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", common),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", common),
        "mistral (window)": ("MistralConfig", "MistralForCausalLM", common | {"sliding_window": WINDOW}),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", common | {"sliding_window": None, "pad_token_id": None}),
        "gemma2": (
            "Gemma2Config",
            "Gemma2ForCausalLM",
            common | {"sliding_window": WINDOW, "query_pre_attn_scalar": 64},
        ),
        "gemma3": (
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            common | {"sliding_window": WINDOW, "query_pre_attn_scalar": 64},
        ),
        "mixtral 8x2": (
            "MixtralConfig",
            "MixtralForCausalLM",
            common | {"sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2},
        ),
    }


def build(path: Path, config_cls: str, model_cls: str, kwargs: dict, tokenizer) -> None:
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    model.save_pretrained(path)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))


def measure(path: Path) -> dict:
    t0 = time.perf_counter()
    llm = LLM(str(path), progress=False, kv_cache_memory="512MiB")
    load = time.perf_counter() - t0
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 49000, (256,), generator=g).tolist() for _ in range(16)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm-up

    def rate(batch: list[list[int]], new: int) -> float:  # the median of three runs, tokens/s
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            llm.generate(batch, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
            times.append(time.perf_counter() - t0)
        return len(batch) * new / statistics.median(times)

    single, batched = rate(prompts[:1], 64), rate(prompts, 32)
    out = {
        "load_s": load,
        "single_tok_s": single,
        "batched_tok_s": batched,
        "dtype": str(llm.dtype),
        "params_m": sum(p.numel() for p in llm.model.parameters()) / 1e6,
    }
    llm.close()
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    names = list(res["families"])
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.27
    for k, (key, label) in enumerate(
        (("load_s", "load time"), ("single_tok_s", "single stream"), ("batched_tok_s", "batched"))
    ):
        ratios = [res["families"][n][key] / res["families"][n]["llama"][key] for n in names]
        ax.bar([i + (k - 1) * width for i in range(len(names))], ratios, width, label=f"{label} vs llama")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("ratio to the Llama of the same size")
    ax.legend(fontsize=8)
    fig.suptitle(f"Families on the shared decoder - CPU: {cpu_info().describe()}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    args = p.parse_args()
    log(f"CPU: {cpu_info().describe()}")
    res: dict = {"cpu": cpu_info().as_dict(), "torch": torch.__version__, "layers": args.layers, "families": {}}
    base = LLM(progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        specs = families(args.layers)
        llama = Path(tmp) / "llama"
        build(llama, *specs.pop("llama"), base.tokenizer)
        measure(llama)  # warm the process up
        for name, (config_cls, model_cls, kwargs) in specs.items():
            path = Path(tmp) / name.replace(" ", "_")
            build(path, config_cls, model_cls, kwargs, base.tokenizer)
            ref = measure(llama)
            res["families"][name] = r = measure(path) | {"llama": ref}
            log(
                f"{name}: {r['params_m']:.0f}M params, load {r['load_s']:.2f} s ({ref['load_s']:.2f}), single "
                f"{r['single_tok_s']:.1f} tok/s ({ref['single_tok_s']:.1f}), batched {r['batched_tok_s']:.1f} tok/s "
                f"({ref['batched_tok_s']:.1f}); llama's in brackets"
            )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "families.json").write_text(json.dumps(res, indent=2))
    plot(res, RESULTS / "families.png")
    log("wrote bench/results/families.json and families.png")


if __name__ == "__main__":
    main()
