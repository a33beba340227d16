"""Tensor and pipeline parallelism on the CPU (gloo): a split model computes what the
whole one does, and a dead worker ends the engine cleanly.

Each parallel engine starts real worker processes; the reference is the same model,
same options, on one process. Logits are compared in float32 (1e-4), generations
greedy token for token, over workloads that exercise prefix caching, chunked
prefill, preemption, prompt-lookup speculation and int8 weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import child_pids, make_tiny_chat_model, process_alive, seq
from tokenmill import LLM, SamplingParams
from tokenmill.configuration.config import ModelConfig
from tokenmill.distributed.stage import split_microbatches
from tokenmill.errors import EngineDeadError, TokenmillError
from tokenmill.model.loader import load_checkpoint
from tokenmill.model.shard_plan import ModelShard, check_parallel_sizes
from tokenmill.worker.kv_allocation import block_bytes

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time there was a little robot who",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _logits(llm: LLM, token_lists: list[list[int]]) -> torch.Tensor:
    """Logits at every position of each prompt, all in one batch (borrowed blocks)."""
    per = [-(-len(t) // llm.engine.core.block_size) for t in token_lists]
    with llm.engine.core.borrow_blocks(sum(per)) as blocks:
        seqs, at = [], 0
        for i, (tokens, n) in enumerate(zip(token_lists, per, strict=True)):
            seqs.append(seq(tokens, blocks[at : at + n], request_id=str(i)))
            at += n
        return llm.parts.runner.all_logits(seqs)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, llm):
    """Tiny random Llamas with SmolLM2's tokenizer: 8 query heads, 2 KV heads, 4 layers;
    the second has a vocabulary no TP size here divides (49155 rows: padded shards)."""
    paths = {}
    for name, vocab in (("even", llm.config.vocab_size), ("odd", llm.config.vocab_size + 3)):
        path = tmp_path_factory.mktemp(f"tiny-{name}")
        make_tiny_chat_model(path, llm.tokenizer, vocab, num_hidden_layers=4)
        paths[name] = str(path)
    return paths


# ------------------------------------------------------------------ tensor parallel


def test_smollm2_tp3_equals_one_process(float_llm):
    """SmolLM2-135M (9 query heads, 3 KV heads) split three ways: logits within 2.5e-4 (float32
    summation order: a row-parallel layer's shards sum their partial products apart and then
    all-reduce; 0.6-1.3e-4 measured after 30 layers, on logits of magnitude ~20), greedy
    generations identical. (Split across processes the GGUF is dequantised at load: the one
    process's float arithmetic is its twin.)"""
    llm = float_llm
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    expected_logits = _logits(llm, prompts)
    expected = _tokens(llm.generate(PROMPTS, GREEDY))
    with LLM(dtype="float32", progress=False, kv_cache_memory="64MiB", tensor_parallel_size=3) as split:
        torch.testing.assert_close(_logits(split, prompts), expected_logits, atol=2.5e-4, rtol=0)
        assert _tokens(split.generate(PROMPTS, GREEDY)) == expected


@pytest.mark.parametrize(("tp", "model"), [(2, "even"), (4, "odd")])
def test_tiny_llama_tensor_parallel(tiny, tp, model):
    """TP=2, and TP=4 with 2 KV heads (each replicated on two ranks) and a vocabulary
    the ranks split unevenly."""
    opts = dict(dtype="float32", progress=False, kv_cache_memory="32MiB", max_num_batched_tokens=48)
    with LLM(tiny[model], **opts) as whole:
        prompts = [whole.tokenizer.encode(p) for p in PROMPTS]
        expected_logits = _logits(whole, prompts)
        expected = _tokens(whole.generate(PROMPTS, GREEDY))
    with LLM(tiny[model], tensor_parallel_size=tp, **opts) as split:
        torch.testing.assert_close(_logits(split, prompts), expected_logits, atol=1e-4, rtol=0)
        assert _tokens(split.generate(PROMPTS, GREEDY)) == expected


# ---------------------------------------------------------------- pipeline parallel


def _kv_memory(path: str, num_blocks: int, tp: int, pp: int) -> str:
    """Bytes that buy ``num_blocks`` blocks on each rank of this split."""
    cfg: ModelConfig = load_checkpoint(path, torch.float32, progress=False).config
    return f"{num_blocks * block_bytes(ModelShard(0, tp, 0, pp).local_config(cfg), 16, torch.float32)}B"


@pytest.mark.parametrize(("tp", "pp", "quantization"), [(1, 2, "int8"), (2, 2, "none")])
def test_pipeline_with_every_feature(tiny, tp, pp, quantization):
    """PP=2 (int8 weights) and TP=2 x PP=2: a shared prefix (prefix caching), prompts
    longer than the step budget (chunked prefill), a pool too small for all
    (preemption) and prompt-lookup speculation, token-identical to one process with
    the same options."""
    path = tiny["even"]
    opts = dict(
        dtype="float32",
        progress=False,
        max_num_batched_tokens=24,
        speculative="ngram",
        num_speculative_tokens=3,
        spec_disable_batch_size=8,
        quantization=quantization,
    )
    prefix = "You are a helpful assistant. Answer briefly and precisely. "
    prompts = [prefix + p for p in PROMPTS] * 2
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(path, kv_cache_memory=_kv_memory(path, 14, 1, 1), **opts) as whole:
        expected = _tokens(whole.generate(prompts, params))
        assert whole.engine.core.num_preemptions > 0 and whole.engine.core.prefix_cache_stats.hits > 0
    with LLM(
        path, kv_cache_memory=_kv_memory(path, 14, tp, pp), tensor_parallel_size=tp, pipeline_parallel_size=pp, **opts
    ) as split:
        assert split.num_blocks == 14
        assert _tokens(split.generate(prompts, params)) == expected
        engine = split.engine
        assert engine.core.num_preemptions > 0 and engine.core.prefix_cache_stats.hits > 0
        assert engine.core.spec_decode_stats.num_accepted_tokens > 0
        assert engine.core.block_pool.num_free == engine.core.block_pool.num_blocks


@pytest.mark.parametrize(("tp", "pp", "quantization", "atol"), [(1, 2, "none", 1e-4), (2, 2, "int8", 2e-2)])
def test_split_logits(tiny, tp, pp, quantization, atol):
    """Float32 logits of PP=2 within 1e-4. With int8 weights the int8 kernels return
    bfloat16, so a row-parallel layer's partial sums are rounded before they are added:
    TP agrees to bfloat16 precision (a pipeline split alone is exact, above)."""
    opts = dict(dtype="float32", progress=False, kv_cache_memory="32MiB", quantization=quantization)
    with LLM(tiny["even"], **opts) as whole:
        prompts = [whole.tokenizer.encode(p) for p in PROMPTS]
        expected = _logits(whole, prompts)
    with LLM(tiny["even"], tensor_parallel_size=tp, pipeline_parallel_size=pp, **opts) as split:
        torch.testing.assert_close(_logits(split, prompts), expected, atol=atol, rtol=0)


def test_microbatches_split_by_tokens():
    seqs = [seq([1] * n, list(range(8)), request_id=str(i)) for i, n in enumerate([1, 1, 1, 1, 40, 3])]
    groups = split_microbatches(seqs, 2)
    assert [len(g) for g in groups] == [5, 1] and sum(groups, []) == seqs
    assert split_microbatches(seqs[:1], 4) == [seqs[:1]]
    assert [len(g) for g in split_microbatches(seqs[:3], 3)] == [1, 1, 1]


# ------------------------------------------------------------------ failures


def test_sizes_that_do_not_split_are_refused(llm):
    with pytest.raises(TokenmillError, match=r"tensor_parallel_size 2 does not divide the 9 attention heads"):
        LLM(progress=False, tensor_parallel_size=2)
    with pytest.raises(TokenmillError, match=r"pipeline_parallel_size 4 does not divide the 30 layers"):
        LLM(progress=False, pipeline_parallel_size=4)
    with pytest.raises(TokenmillError, match="LoRA adapters are not supported"):
        LLM(progress=False, tensor_parallel_size=3, enable_lora=True)
    cfg = llm.config
    check_parallel_sizes(cfg, 3, 5)
    with pytest.raises(TokenmillError, match=r"KV heads"):
        check_parallel_sizes(ModelConfig(**{**cfg.__dict__, "num_heads": 12, "num_kv_heads": 3}), 2, 1)


def test_killed_worker_ends_the_engine_cleanly(tiny):
    llm = LLM(
        tiny["even"],
        dtype="float32",
        progress=False,
        kv_cache_memory="32MiB",
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
    )
    workers = [p.pid for p in llm.parts.runner.cluster.procs]
    assert len(workers) == 3 and all(process_alive(p) for p in workers)
    victim = workers[1]
    threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"worker rank 2 exited with code -9"):
        llm.generate(PROMPTS * 8, SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True))
    assert time.monotonic() - start < 30
    assert not any(process_alive(p) for p in workers), "a worker outlived the engine"
    assert not set(child_pids(os.getpid())) & set(workers)
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS[:1], GREEDY)
    llm.close()


def test_failing_worker_is_named(tiny):
    with LLM(tiny["even"], dtype="float32", progress=False, kv_cache_memory="32MiB", tensor_parallel_size=2) as llm:
        llm.parts.runner.cluster.control.broadcast(b"not a message")  # the worker raises on it
        with pytest.raises(EngineDeadError, match=r"worker rank 1 failed: .*RankWireError: not a rank message"):
            llm.generate(PROMPTS[:2], GREEDY)
        assert not any(process_alive(p.pid) for p in llm.parts.runner.cluster.procs)


# ------------------------------------------------------- a parent killed (host/lifetime.py)

# `tokenmill serve`'s layout with tensor parallelism: this API process, an engine core it
# spawned, and the worker that core started
API_PROCESS = (
    "import functools, sys, time\n"
    "from pathlib import Path\n"
    "from tokenmill.configuration.args import engine_args\n"
    "from tokenmill.core_process import run_engine_core\n"
    "from tokenmill.engine.api.core_client import AsyncCoreClient\n"
    "from tokenmill.model.tokenizer import load_tokenizer\n"
    "args = engine_args(model=sys.argv[1], dtype='float32', kv_cache_memory='32MiB', tensor_parallel_size=2)\n"
    "client = AsyncCoreClient(functools.partial(run_engine_core, args), load_tokenizer(Path(sys.argv[1])))\n"
    "print(client.process.pid, flush=True)\n"
    "time.sleep(600)\n"
)
# a driver that is killed the moment it has started its worker (still importing torch)
DRIVER = (
    "import time\n"
    "from tokenmill.distributed.cluster import Cluster\n"
    "print(Cluster.launch(2).procs[0].pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid``: the children of each of its threads, and theirs."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = {int(p) for p in (task / "children").read_text().split()}
        except OSError:  # the thread ended meanwhile
            continue
        for child in children - found:
            found |= {child} | _descendants(child)
    return found


def _assert_all_gone(pids: set[int], timeout: float, log: Path) -> None:
    """Every one of ``pids`` ends within ``timeout`` s (those that do not are killed, so
    that a failure leaves no process behind either)."""
    deadline = time.monotonic() + timeout
    while (alive := {p for p in pids if process_alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, f"processes {sorted(alive)} outlived their killed parent by {timeout} s\n{log.read_text()}"


def _start(code: str, arg: str, log: Path) -> tuple[subprocess.Popen, int]:
    """Run ``code`` in a fresh interpreter; the pid it prints."""
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-c", code, arg], stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise AssertionError(f"the parent process exited with {proc.returncode}:\n{log.read_text()}")
    return proc, int(line)


def test_killed_api_process_takes_its_core_and_workers_along(tiny, tmp_path):
    """SIGKILL the API process of a split model's server while its engine core is busy
    (stopped here, as stuck as a process gets: it reads no pipe, runs no thread): the
    core ends at once (the kernel's parent-death signal), then its worker (its own)."""
    log = tmp_path / "stderr"
    api, core = _start(API_PROCESS, tiny["even"], log)
    try:
        family = _descendants(api.pid)
        assert core in family and _descendants(core), "the engine core has no worker process"
        os.kill(core, signal.SIGSTOP)
    finally:
        api.kill()
        api.wait()
    _assert_all_gone(family, 5.0, log)


def test_worker_whose_driver_died_as_it_started_exits(tmp_path):
    """The driver is killed while its worker still imports torch: the worker, once up,
    finds its parent gone (the pid the driver wrote, not its parent now: init's) and
    exits instead of waiting minutes for a store that is gone."""
    log = tmp_path / "stderr"
    driver, worker = _start(DRIVER, "", log)
    driver.kill()
    driver.wait()
    _assert_all_gone({worker}, 60.0, log)
    assert f"parent process {driver.pid} is gone" in log.read_text()


def test_torchrun_two_nodes(float_llm, tmp_path):
    """The README's two-node example, both "nodes" on this machine: each runs the same
    command under torchrun; rank 0 prints the generation, rank 1 follows and exits 0. (Split
    across processes the GGUF is dequantised: one process's float arithmetic is its twin.)"""
    llm = float_llm
    import shutil
    import socket
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun is not None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompt = "The capital of France is"
    cmd = [
        torchrun,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "-m",
        "tokenmill",
        "generate",
        prompt,
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--dtype",
        "float32",
        "--pipeline-parallel-size",
        "2",
        "--kv-cache-memory",
        "64MiB",
    ]
    nodes = [
        subprocess.Popen(
            [*cmd[:1], "--node-rank", str(r), *cmd[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    outs = [n.communicate(timeout=240) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    expected = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    assert outs[0][0].strip() == expected.strip()
    assert outs[1][0].strip() == ""
