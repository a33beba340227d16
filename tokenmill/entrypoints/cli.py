"""The `tokenmill` command: generate and chat, streaming tokens as they come; serve, plan,
benchmark, train a draft head, quantise a model.

Engine options are flags with the same names as the `LLM` keywords, generated from
the config dataclasses (``tokenmill.configuration.args``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from tokenmill.configuration.args import add_config_arguments, add_engine_arguments, engine_args_from_namespace
from tokenmill.configuration.flag_types import (
    NON_NEGATIVE_FLOAT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    existing_file,
    text_or_file,
)
from tokenmill.configuration.serving_config import ReplicaConfig, ServerConfig
from tokenmill.distributed.env import torchrun_rank
from tokenmill.errors import TokenmillError
from tokenmill.host.lifetime import EXIT_WITH_PARENT_ENV

DEFAULT_CHAT_PROMPT = "What is the capital of France? Answer in one sentence."


class Parser(argparse.ArgumentParser):
    """A bad argument is one line, ``tokenmill serve: error: argument --port: ...``, and
    exit 2: not argparse's usage first, which for `serve` is a hundred lines of flags
    above the one that matters. (Subcommands' parsers are this class too.)"""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
    c = p.add_argument_group("structured output (one of)")
    c.add_argument(
        "--json-schema", type=text_or_file, default=None, metavar="SCHEMA", help="a JSON schema, as text or @file"
    )
    c.add_argument("--json-object", action="store_true", help="any JSON object")
    c.add_argument("--regex", default=None)
    c.add_argument("--choice", action="append", default=None, help="an allowed output (repeatable)")
    c.add_argument("--grammar", type=text_or_file, default=None, metavar="GRAMMAR", help="Lark or GBNF text, or @file")


def _structured(args: argparse.Namespace):
    """--json-schema / --json-object / --regex / --choice / --grammar as StructuredOutputs (or None);
    an @file's text was read as the flag was parsed."""
    from tokenmill.structured.constraint import StructuredOutputs

    given = {
        "json": args.json_schema,
        "json_object": args.json_object,
        "regex": args.regex,
        "choice": args.choice,
        "grammar": args.grammar,
    }
    if not any(given.values()):
        return None
    return StructuredOutputs(**{k: v for k, v in given.items() if v})


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tokenmill", description="LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt, streaming the text")
    gen.add_argument("prompt")
    add_engine_arguments(gen)
    _add_sampling_args(gen, max_tokens=64)
    chat = sub.add_parser("chat", help="chat with the model (one message, or interactive without one)")
    chat.add_argument("message", nargs="?", default=None, help="one message; omit for an interactive session")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_arguments(chat)
    _add_sampling_args(chat, max_tokens=256)
    serve = sub.add_parser("serve", help="serve the OpenAI API over HTTP")
    serve.add_argument(
        "model_positional",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as --model takes it (a path or a Hub id), for `tokenmill serve ORG/NAME` as vLLM takes it",
    )
    add_config_arguments(serve.add_argument_group("server"), ServerConfig)
    add_config_arguments(serve.add_argument_group("replicas (Ray Serve; pip install 'tokenmill[ray]')"), ReplicaConfig)
    add_engine_arguments(serve, several_models=True)
    plan = sub.add_parser("plan", help="weights, KV per token, capacity and a decode bound for a configuration")
    from tokenmill.plan.command import add_arguments as add_plan_arguments

    add_plan_arguments(plan)
    add_engine_arguments(plan, several_models=True)
    train = sub.add_parser("train-draft", help="train an EAGLE or Medusa head for the model on its own answers")
    _add_train_draft_args(train)
    quantize = sub.add_parser(
        "quantize", help="quantise a model's linears (RTN, GPTQ, AWQ) into a compressed-tensors folder"
    )
    _add_quantize_args(quantize)
    pull = sub.add_parser("pull", help="download a Hub model (ORG/NAME or ORG/NAME:QUANT) into the Hub cache")
    pull.add_argument("model", metavar="ID", help="a Hub repo id: ORG/NAME, ORG/NAME:QUANT or hf.co/ORG/NAME:QUANT")
    pull.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    sub.add_parser("list", help="the models in the Hub cache: revision, type, size, and whether tokenmill serves them")
    rm = sub.add_parser("rm", help="remove a model from the Hub cache")
    rm.add_argument("model", metavar="ID", help="a Hub repo id: ORG/NAME")
    rm.add_argument("--revision", default=None, help="remove only this cached branch, tag or commit")
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from tokenmill.loadgen.serve import add_arguments

    add_arguments(bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server"))
    from tokenmill.tune.command import add_arguments as add_tune_arguments

    add_tune_arguments(
        sub.add_parser("tune", help="find the serve settings that meet a latency SLO at the lowest cost per token")
    )
    return parser


def _add_train_draft_args(p: argparse.ArgumentParser) -> None:
    from tokenmill.speculative.training.options import TrainOptions

    d = TrainOptions()
    p.add_argument("--method", choices=("eagle", "medusa"), default="eagle", help="the head to train (default eagle)")
    p.add_argument("--output", required=True, help="folder for the data, the head (OUTPUT/head) and its plots")
    p.add_argument("--model", default=None, help="the target (.gguf, folder or Hub id); default: SmolLM2-135M-Instruct")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (a GPU where there is one)")
    p.add_argument(
        "--prompts",
        type=existing_file,
        default=None,
        help="a text file, one prompt per line (default: the bundled chat prompts)",
    )
    p.add_argument("--num-prompts", type=POSITIVE_INT, default=1024, help="prompts to answer (default 1024)")
    p.add_argument("--max-tokens", type=POSITIVE_INT, default=256, help="tokens per answer (default 256)")
    p.add_argument(
        "--epochs", type=POSITIVE_FLOAT, default=d.epochs, help=f"passes over the answers (default {d.epochs})"
    )
    p.add_argument(
        "--batch-size", type=POSITIVE_INT, default=d.batch_size, help=f"conversations per step (default {d.batch_size})"
    )
    p.add_argument("--lr", type=POSITIVE_FLOAT, default=d.lr, help=f"peak learning rate (default {d.lr})")
    p.add_argument(
        "--unroll",
        type=POSITIVE_INT,
        default=d.unroll,
        help=f"EAGLE: drafting steps trained together (default {d.unroll})",
    )
    p.add_argument(
        "--draft-vocab-size",
        type=POSITIVE_INT,
        default=d.draft_vocab_size,
        help=f"EAGLE: tokens its LM head drafts (default {d.draft_vocab_size})",
    )
    p.add_argument(
        "--token-loss-weight",
        type=NON_NEGATIVE_FLOAT,
        default=d.token_loss_weight,
        help=f"EAGLE: weight of the token cross-entropy next to the feature loss (default {d.token_loss_weight})",
    )
    p.add_argument(
        "--medusa-heads", type=POSITIVE_INT, default=d.medusa_heads, help=f"Medusa: heads (default {d.medusa_heads})"
    )
    p.add_argument(
        "--eval-every",
        type=POSITIVE_INT,
        default=d.eval_every,
        help=f"steps between held-out evaluations (default {d.eval_every})",
    )
    p.add_argument("--seed", type=int, default=d.seed)


def _add_quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "paths",
        nargs="+",
        metavar="[MODEL] OUT",
        help="the model (.gguf, folder or Hub id; default: SmolLM2-135M-Instruct) and the folder to write",
    )
    p.add_argument("--method", choices=("rtn", "gptq", "awq"), default="gptq", help="(default gptq)")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4, help="weight bits: W4A16 or W8A16 (default 4)")
    p.add_argument(
        "--group-size",
        type=POSITIVE_INT,
        default=128,
        help="input channels per scale (default 128; a layer it does not divide takes the largest "
        "power of two from 32 that does)",
    )
    p.add_argument(
        "--calibration",
        type=existing_file,
        default=None,
        metavar="FILE",
        help="a text file (default: the bundled prose mixed with the Python standard library's documentation)",
    )
    p.add_argument(
        "--samples", type=POSITIVE_INT, default=128, help="calibration samples, as the text allows (default 128)"
    )
    p.add_argument("--seq-len", type=POSITIVE_INT, default=512, help="tokens per calibration sample (default 512)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument(
        "--sym", dest="symmetric", action="store_true", default=True, help="symmetric, no zero points (default)"
    )
    sym.add_argument(
        "--asym",
        dest="symmetric",
        action="store_false",
        help="with zero points (vLLM and tokenmill load it; transformers 5.24 does not)",
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="of the scales and the unquantised tensors (default bfloat16)",
    )
    p.add_argument("--no-clip", dest="clip", action="store_false", help="AWQ: skip the clipping-range search")
    p.add_argument(
        "--no-act-order",
        dest="act_order",
        action="store_false",
        help="GPTQ: take columns in their own order, not by falling activation energy (the default, as "
        "llm-compressor's actorder static: same format, groups unchanged)",
    )


def cmd_quantize(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.quantize.run import QuantizeOptions, quantize

    if len(args.paths) > 2:
        raise TokenmillError(f"quantize takes [MODEL] OUT, got {len(args.paths)} paths")
    model, out = (None, args.paths[0]) if len(args.paths) == 1 else args.paths
    opts = QuantizeOptions(
        method=args.method,
        bits=args.bits,
        group_size=args.group_size,
        symmetric=args.symmetric,
        samples=args.samples,
        seq_len=args.seq_len,
        calibration=args.calibration,
        dtype=getattr(torch, args.dtype),
        clip=args.clip,
        act_order=args.act_order,
    )
    report = quantize(model, out, opts)
    errors = [r.error for r in report.linears]
    baseline = [r.rtn_error for r in report.linears]
    print(
        f"{out}: {len(errors)} linears, mean relative output error {sum(errors) / len(errors):.4f} "
        f"(round to nearest: {sum(baseline) / len(baseline):.4f})\n"
        f"use it: tokenmill chat --model {out}"
    )
    return 0


def cmd_train_draft(args: argparse.Namespace) -> int:
    from tokenmill.llm import LLM
    from tokenmill.speculative.training.options import TrainOptions
    from tokenmill.speculative.training.train import read_prompts, train_draft

    opts = TrainOptions(
        method=args.method,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        unroll=args.unroll,
        draft_vocab_size=args.draft_vocab_size,
        medusa_heads=args.medusa_heads,
        token_loss_weight=args.token_loss_weight,
        eval_every=args.eval_every,
        seed=args.seed,
    )
    try:
        texts = read_prompts(args.prompts, args.num_prompts)
        llm = LLM(args.model, device=args.device, max_num_seqs=64)
        head = train_draft(llm, args.method, args.output, texts, args.max_tokens, opts)
    except (OSError, ValueError) as e:
        raise TokenmillError(str(e)) from None
    print(f"head: {head}\nuse it: tokenmill chat --speculative {args.method} --draft-model {head}")
    return 0


def _llm(args: argparse.Namespace):
    from tokenmill.llm import LLM

    return LLM(args=engine_args_from_namespace(args))


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
        structured=_structured(args),
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
    from tokenmill.entrypoints.launch import serve

    if args.model_positional is not None:
        if args.model:
            raise TokenmillError(f"the model is given twice: {args.model_positional} and --model; give one")
        args.model = [args.model_positional]
    return serve(args)


def _hub_ref(text: str):
    from tokenmill.hub.refs import parse_ref

    ref = parse_ref(text)
    if ref is None:
        raise TokenmillError(f"{text!r} is not a Hugging Face repo id (ORG/NAME, ORG/NAME:QUANT, hf.co/ORG/NAME)")
    return ref


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def cmd_pull(args: argparse.Namespace) -> int:
    from tokenmill.hub.download import resolve
    from tokenmill.model.paths import check_architecture

    ref = _hub_ref(args.model)
    got = resolve(ref, args.revision, update=True, check=check_architecture(ref))
    quant = f" {got.files.quant}" if got.files.quant else ""
    print(f"{ref} ({got.files.kind}{quant}, revision {got.revision}, commit {got.commit[:12]}): {_size(got.size)}")
    print(got.path)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from tokenmill.hub.cache import cached_models
    from tokenmill.hub.download import cache_dir
    from tokenmill.model.paths import servable

    rows = []
    for m in cached_models():
        kinds = [(f"gguf {tag}", *q) for tag, q in m.quants.items()] if m.quants else [(m.kind, m.folder, m.size)]
        for kind, path, size in kinds:
            rows.append((m.repo_id, m.revision, kind, _size(size), servable(m.kind, path)))
    if not rows:
        print(f"no models in the Hub cache ({cache_dir()}): `tokenmill pull ORG/NAME` downloads one")
        return 0
    head = ("MODEL", "REVISION", "TYPE", "SIZE", "SERVES")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from tokenmill.hub.cache import remove

    ref = _hub_ref(args.model)
    freed, commits = remove(ref, args.revision)
    print(f"removed {ref} ({len(commits)} revision{'s' * (len(commits) != 1)}): {_size(freed)} freed")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from tokenmill.configuration.args import served_models
    from tokenmill.plan.command import run, run_several

    if args.kv_cache_memory is None:
        args.kv_cache_memory = "1GiB"
    planned = served_models(args)  # several --model NAME=PATH: as `tokenmill serve` would split the KV budget
    if len(planned) > 1:
        return run_several(args, planned)
    from tokenmill.llm import LLM

    return run(args, LLM(args=planned[0][1]))


def cmd_bench(args: argparse.Namespace) -> int:
    from tokenmill.loadgen.serve import run

    return run(args)


def cmd_tune(args: argparse.Namespace) -> int:
    from tokenmill.tune.command import run

    return run(args)


def main(argv: Sequence[str] | None = None) -> int:
    if os.environ.get(EXIT_WITH_PARENT_ENV):  # started by a tokenmill process (tune's servers): end with it
        from tokenmill.host.lifetime import exit_with_parent

        exit_with_parent(int(os.environ.pop(EXIT_WITH_PARENT_ENV)))
    args = build_parser().parse_args(argv)
    if args.command in ("generate", "chat", "serve", "plan") and torchrun_rank() > 0:
        # Under torchrun every rank runs the same command line; only rank 0 drives the
        # engine (and serves), the others hold their shards and follow it.
        from tokenmill.distributed.rank_process import run_torchrun_worker

        return run_torchrun_worker()
    try:
        commands = {
            "generate": cmd_generate,
            "chat": cmd_chat,
            "serve": cmd_serve,
            "plan": cmd_plan,
            "bench": cmd_bench,
            "train-draft": cmd_train_draft,
            "quantize": cmd_quantize,
            "tune": cmd_tune,
            "pull": cmd_pull,
            "list": cmd_list,
            "rm": cmd_rm,
        }
        return commands[args.command](args)
    except TokenmillError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
