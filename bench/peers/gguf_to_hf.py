"""Write a Hugging Face folder (float32 safetensors + tokenizer) from the default GGUF,
for peers that read only HF folders (vLLM). Run with tokenmill's .venv (transformers).

    .venv/bin/python bench/peers/gguf_to_hf.py /work/peers/smollm2-hf
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill.model.paths import default_model_path

if __name__ == "__main__":
    out = sys.argv[1]
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # The GGUF was dequantised to float32 at load; drop the quantiser marker so it saves.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.float32
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    print(f"wrote {out}")
