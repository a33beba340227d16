"""Decode throughput of SmolLM2 (default model, dtype auto, native kernels) at batch 1
and 8, for a same-run A/B of two checkouts:

    for c in /tmp/before .; do PYTHONPATH=$c .venv/bin/python bench/decode_ab.py; done
"""

import json
import statistics
import time

import tokenmill
from tokenmill import LLM, SamplingParams

llm = LLM(progress=False, kv_cache_memory="256MiB")
p = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
prompts = ["Write a story about a robot who learns to paint."] * 8
llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))
res = {}
for n in (1, 8):
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(prompts[:n], p)
        times.append(time.perf_counter() - t0)
    res[n] = n * 128 / statistics.median(times)
print(json.dumps({"checkout": tokenmill.__file__, "tok_s": res}))
