"""Decode throughput with sampling (temperature/top-p, and with penalties) at batch 1
and 16, for a same-run A/B of two checkouts (the sampler's per-step work: parameter rows
and penalty counts kept by the runner, against rebuilt from lists):

    for c in /tmp/before . /tmp/before .; do PYTHONPATH=$c .venv/bin/python bench/sampling_ab.py; done
"""

import json
import statistics
import time

import tokenmill
from tokenmill import LLM, SamplingParams

llm = LLM(progress=False, kv_cache_memory="256MiB")
prompts = ["Write a story about a robot who learns to paint."] * 16
llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))
kinds = {
    "top_p": dict(temperature=0.8, top_p=0.9),
    "penalties": dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.3),
}
res = {}
for kind, kw in kinds.items():
    for n in (1, 16):
        times = []
        for r in range(3):
            p = [SamplingParams(max_tokens=128, ignore_eos=True, seed=i + 100 * r, **kw) for i in range(n)]
            t0 = time.perf_counter()
            llm.generate(prompts[:n], p)
            times.append(time.perf_counter() - t0)
        res[f"{kind}@{n}"] = round(n * 128 / statistics.median(times), 1)
print(json.dumps({"checkout": tokenmill.__file__, "tok_s": res}))
