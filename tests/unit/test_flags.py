"""Every flag is checked where it is declared: a bad value is refused while the command
line is parsed, as one line naming the flag and exit 2, and a good one still parses to
what the command uses. Parsing only: nothing here loads a model, starts a server or runs
a tune."""

from __future__ import annotations

import argparse

import pytest

from tokenmill.configuration.args import engine_keywords
from tokenmill.configuration.serving_config import ReplicaConfig, ServerConfig
from tokenmill.entrypoints.cli import build_parser

SERVE = ("serve",)
PLAN = ("plan",)
TUNE = ("tune", "--slo", "ttft_p99=2s", "--price-per-hour", "1")
BENCH = ("bench", "serve", "--base-url", "http://127.0.0.1:1")
QUANTIZE = ("quantize", "out")
TRAIN = ("train-draft", "--output", "out")
GENERATE = ("generate", "hi")
HERE = __file__  # a file that exists, for the flags that read one

# (command line before the flag, flag, a bad value, a good value, what the good one parses to)
CASES = [
    # the issue's
    (PLAN, "--context-len", "0", "512", 512),
    (SERVE, "--port", "99999", "65535", 65535),
    (TUNE, "--workload", "/nonexistent.jsonl", "shared-prefix", "shared-prefix"),
    (TUNE, "--price-per-hour", "-1", "0", 0.0),
    (TUNE, "--validate-seconds", "-1", "30", 30.0),
    (SERVE, "--max-request-bytes", "-5", "4096", 4096),
    (TUNE, "--time-budget", "0", "0.5", 0.5),
    # and the others of their kinds, command by command
    (SERVE, "--port", "http", "8080", 8080),
    (SERVE, "--request-body-timeout", "0", "0.5", 0.5),
    (SERVE, "--drain-timeout", "nan", "0", 0.0),
    (SERVE, "--max-queue", "-1", "0", 0),
    (SERVE, "--max-open-requests", "0", "1", 1),
    (SERVE, "--response-cache-memory", "lots", "64MiB", "64MiB"),
    (SERVE, "--semantic-cache-threshold", "0", "1", 1.0),
    (SERVE, "--router-threshold", "1.5", "0", 0.0),
    (SERVE, "--api-key-file", "/nonexistent/keys", HERE, HERE),
    (SERVE, "--route-load-cost", "-3", "auto", "auto"),
    (SERVE, "--replica-threads", "0", "2", 2),
    (SERVE, "--replica-gpus", "-0.5", "0.5", 0.5),
    (PLAN, "--bandwidth", "0", "20", 20.0),
    (PLAN, "--price-per-hour", "-2", "2", 2.0),
    (PLAN, "--concurrency", "0", "4", 4),
    (PLAN, "--measure-seconds", "inf", "5", 5.0),
    (TUNE, "--slo", "ttft_p99=0s", "ttft_p99=2s,tpot_p99=100ms", "ttft_p99=2s,tpot_p99=100ms"),
    (TUNE, "--slo", "latency=2s", "tpot_p99=100ms", "tpot_p99=100ms"),
    (TUNE, "--rates", "1,0", "0.5,1", "0.5,1"),
    (TUNE, "--rounds", "0", "1", 1),
    (TUNE, "--validate-sets", "0", "1", 1),
    (TUNE, "--min-gain", "1", "0", 0.0),
    (BENCH, "--num-prompts", "0", "8", 8),
    (BENCH, "--request-rate", "1,-2", "inf,1.5", "inf,1.5"),
    (BENCH, "--dataset-path", "/nonexistent.jsonl", HERE, HERE),
    (BENCH, "--slo-tpot", "-0.1", "0.1", 0.1),
    (QUANTIZE, "--samples", "0", "4", 4),
    (QUANTIZE, "--calibration", "/nonexistent.txt", HERE, HERE),
    (TRAIN, "--lr", "0", "0.001", 0.001),
    (TRAIN, "--token-loss-weight", "-1", "0", 0.0),
    (TRAIN, "--prompts", "/nonexistent.txt", HERE, HERE),
    (GENERATE, "--json-schema", "@/nonexistent.json", '{"type": "object"}', '{"type": "object"}'),
]


def _command(before: tuple[str, ...]) -> str:
    """The subcommand's words: what its parser calls itself after `tokenmill`."""
    return " ".join(before[:2] if before[0] == "bench" else before[:1])


@pytest.mark.parametrize("before, flag, bad, good, parsed", CASES, ids=[f"{c[1]}={c[2]}" for c in CASES])
def test_a_bad_value_is_one_line_naming_its_flag_and_exit_2(capsys, before, flag, bad, good, parsed):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*before, f"{flag}={bad}"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.count("\n") == 1, err  # one line: no usage dump, no traceback
    assert err.startswith(f"tokenmill {_command(before)}: error: argument {flag}: "), err
    args = build_parser().parse_args([*before, f"{flag}={good}"])
    assert getattr(args, flag[2:].replace("-", "_")) == parsed


def test_an_at_file_is_read_when_its_flag_is_parsed(tmp_path):
    """--json-schema @FILE: the file's text, read at parsing (a missing one is the flag's
    error above, not a FileNotFoundError once the model has loaded)."""
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    args = build_parser().parse_args(["generate", "hi", "--json-schema", f"@{schema}", "--grammar", "root: 'a'"])
    assert args.json_schema == '{"type": "object"}' and args.grammar == "root: 'a'"


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda: ServerConfig(port=0), "port must be in [1, 65535], got 0"),
        (lambda: ServerConfig(max_request_bytes=-5), "max_request_bytes must be >= 1, got -5"),
        (lambda: ServerConfig(stored_response_ttl=float("inf")), "stored_response_ttl must be a finite number"),
        (lambda: ServerConfig(response_cache_memory="0MiB"), "response_cache_memory must be above 0 bytes"),
        (lambda: ReplicaConfig(replica_gpus=float("inf")), "replica_gpus must be a finite number, got inf"),
    ],
)
def test_a_config_built_from_keywords_is_held_to_the_same_checks(make, said):
    """The check declared on the field is the flag's and the dataclass's: one place."""
    with pytest.raises(ValueError) as e:
        make()
    assert said in str(e.value)


SAMPLING = {"max_tokens", "temperature", "top_p", "top_k", "min_p"}
SAMPLING |= {"repetition_penalty", "presence_penalty", "frequency_penalty"}


def _parsers(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*words, name))


def test_every_numeric_flag_declares_its_range():
    """A plain int or float type lets -1, 0, nan and inf through to the run. The only
    ones left are checked elsewhere on purpose, before anything loads: the engine's (by
    their config dataclasses) and generate/chat's sampling flags (by SamplingParams);
    seeds, where any integer is a seed; and a choice of a few numbers."""
    exempt = set(engine_keywords()) | {"seed"}
    bare = [
        f"tokenmill {' '.join(words)} {action.option_strings[0]}"
        for words, parser in _parsers(build_parser())
        for action in parser._actions
        if action.type in (int, float)
        and action.choices is None
        and action.dest not in exempt
        and not (words in (("generate",), ("chat",)) and action.dest in SAMPLING)
    ]
    assert not bare, f"declare these with a checked type (tokenmill.configuration.flag_types): {bare}"
