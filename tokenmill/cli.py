"""The `tokenmill` command: generate and chat, streaming tokens as they come.

Engine options are flags with the same names as the `LLM` keywords.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tokenmill.errors import TokenmillError

DEFAULT_CHAT_PROMPT = "What is the capital of France? Answer in one sentence."


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct Q4_1)")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (auto: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--kv-cache-memory", default=None, help="KV cache size: bytes, or with a unit such as 1GiB, 512MiB")
    g.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn off reuse of cached prompt blocks")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    g.add_argument("--scheduling", choices=["continuous", "static"], default="continuous",
                   help="continuous batching, or the static-batching baseline")
    g.add_argument("--quantization", choices=["none", "int8", "int4"], default="none",
                   help="weight-only quantisation of the linear layers, applied at load")
    g.add_argument("--quantization-group-size", type=int, default=32,
                   help="int4: input channels per scale (32, as GGUF Q4 blocks)")
    g.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16", "float16", "int8", "fp8"],
                   default="auto", help="how K and V are stored (int8/fp8: quantised, per-token scales)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative", choices=["none", "ngram", "draft", "self"], default=None,
                   help="who drafts tokens for the target to verify: prompt lookup (ngram), a draft model, "
                        "or the target's own first layers (self)")
    s.add_argument("--num-speculative-tokens", type=int, default=4, help="tokens drafted per step")
    s.add_argument("--draft-model", default=None, help="draft model (.gguf or folder) with the target's vocabulary")
    s.add_argument("--draft-layers", type=int, default=None, help="self-speculation: layers the draft runs")
    s.add_argument("--spec-disable-batch-size", type=int, default=None,
                   help="pause speculation above this many running requests")
    s.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest suffix to look up")
    s.add_argument("--prompt-lookup-min", type=int, default=1, help="ngram: shortest suffix to look up")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt, streaming the text")
    gen.add_argument("prompt")
    _add_engine_args(gen)
    _add_sampling_args(gen, max_tokens=64)
    chat = sub.add_parser("chat", help="chat with the model (one message, or interactive without one)")
    chat.add_argument("message", nargs="?", default=None, help="one message; omit for an interactive session")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=256)
    serve = sub.add_parser("serve", help="serve the OpenAI API over HTTP")
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    g.add_argument("--max-queue", type=int, default=None, help="answer 429 while this many requests wait")
    g.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for in-flight requests")
    g.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's file name)")
    _add_engine_args(serve)
    plan = sub.add_parser("plan", help="weights, KV per token, capacity and a decode bound for a configuration")
    from tokenmill.plan import add_arguments as add_plan_arguments

    add_plan_arguments(plan)
    _add_engine_args(plan)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from tokenmill.benchmark.serve import add_arguments

    add_arguments(bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server"))
    return parser


def _llm(args: argparse.Namespace):
    from tokenmill.llm import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling=args.scheduling,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_model=args.draft_model,
        draft_layers=args.draft_layers,
        prompt_lookup_max=args.prompt_lookup_max,
        prompt_lookup_min=args.prompt_lookup_min,
        **({} if args.spec_disable_batch_size is None else {"spec_disable_batch_size": args.spec_disable_batch_size}),
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def _params(args: argparse.Namespace):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def _stream(llm, prompt, params) -> str:
    text = []
    last = None
    for out in llm.stream(prompt, params):
        print(out.delta_text, end="", flush=True)
        text.append(out.delta_text)
        last = out
    print()
    if last is not None and last.timings and last.timings[0].ttft is not None:
        t = last.timings[0]
        n = len(last.token_ids)
        rate = f", {(n - 1) / (t.token_times[-1] - t.first_token):.1f} tok/s decode" if n > 1 else ""
        spec = llm.spec_decode_stats
        if spec.num_drafts:
            rate += f", drafts accepted {spec.acceptance_rate:.0%}"
        print(f"[{n} tokens, finish: {last.finish_reason}, TTFT {t.ttft * 1000:.0f} ms{rate}]", file=sys.stderr)
    return "".join(text)


def cmd_generate(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _llm(args)
    _stream(llm, args.prompt, params)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _llm(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []

    def turn(user: str) -> None:
        messages.append({"role": "user", "content": user})
        prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)
        reply = _stream(llm, prompt, params)
        messages.append({"role": "assistant", "content": reply})

    if args.message is not None:
        print(f"> {args.message}")
        turn(args.message)
        return 0
    print("tokenmill chat: type a message, Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            print()
            return 0
        if user.strip():
            turn(user)


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.server.serve import serve

    return serve(_llm(args), args)


def cmd_plan(args: argparse.Namespace) -> int:
    from tokenmill.plan import run

    if args.kv_cache_memory is None:
        args.kv_cache_memory = "1GiB"
    if args.measure:  # admit as many as the KV cache holds in one step
        args.max_num_batched_tokens = max(args.max_num_batched_tokens, 1 << 17)
        args.max_num_seqs = max(args.max_num_seqs, 4096)
    return run(args, _llm(args))


def cmd_bench(args: argparse.Namespace) -> int:
    from tokenmill.benchmark.serve import run

    return run(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        commands = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "plan": cmd_plan, "bench": cmd_bench}
        return commands[args.command](args)
    except TokenmillError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
