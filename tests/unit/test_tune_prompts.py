"""What `tokenmill tune` sends: no server is sent a prompt twice (a repeat is a prefix-cache
hit the user's traffic would not have), the search's prompts and each validation set's are
disjoint, and a workload file with too few rows is varied, or refused when it cannot be."""

from __future__ import annotations

import argparse
import json
import os
from itertools import combinations
from pathlib import Path

import pytest

from tokenmill.loadgen.prompt_sets import PromptSets, shared_prefixes
from tokenmill.loadgen.serve import synthetic
from tokenmill.tune.command import add_arguments
from tokenmill.tune.command import run as tune_run
from tokenmill.tune.slo import requests_for

pytestmark = pytest.mark.unit
RATES = [0.5, 1, 2, 4, 6]


def write_jsonl(path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "max_tokens": 64}) + "\n" for p in prompts))
    return str(path)


def server_runs(sets: PromptSets, prompt_set: int, seconds: float, rates: list[float]) -> list[str]:
    """The prompts of one server's runs climbing ``rates`` with ``prompt_set``, as tune's
    Session draws them."""
    return [r["prompt"] for rate in rates for r in sets.take(requests_for(rate, seconds), rate, prompt_set)[0]]


def test_a_server_is_never_sent_a_prompt_twice_while_its_set_has_rows(tmp_path):
    """The issue's case the other way round: with rows enough, a server's runs are the
    file's own prompts, each once (cycled, the second run was the first one again)."""
    rows = [r["prompt"] for r in synthetic("mixed", 300, seed=3)]
    sets = PromptSets(write_jsonl(tmp_path / "w.jsonl", rows), 3, seed=0)  # the search's and two validation sets
    first, varied_first = sets.take(30, 1.0, 0)
    second, varied_second = sets.take(40, 2.0, 0)
    sent = [r["prompt"] for r in first + second]
    assert len(set(sent)) == 70 and varied_first == varied_second == 0
    assert set(sent) <= set(rows[0::3])  # the file's rows themselves, from the search's share


@pytest.mark.parametrize("workload", ["file", "mixed", "shared-prefix"])
def test_the_search_and_each_validation_set_share_no_prompt(tmp_path, workload):
    """Runs far longer than the file (a 64-row file, minutes of runs) and every rate: no
    prompt of one set is in another, and none repeats within a set's server. Synthetic sets
    too, at rates whose seeds collided before (0.081 and 8 req/s, 7.919 apart)."""
    rows = [r["prompt"] for r in synthetic("mixed", 64, seed=5)]
    name = write_jsonl(tmp_path / "w.jsonl", rows) if workload == "file" else workload
    seen = [server_runs(PromptSets(name, 3, seed=0), k, 20, [*RATES, 0.081, 8]) for k in range(3)]
    for prompts in seen:
        assert len(set(prompts)) == len(prompts)
    for a, b in combinations(seen, 2):
        assert not set(a) & set(b)


def test_a_run_past_its_sets_rows_varies_them_sharing_no_more_than_the_files_rows(tmp_path):
    """A 12-row file, half behind one system prompt: a set of 4 rows asked for 200 prompts
    gives 200 different ones; each keeps the prefix its row shares with the file (the system
    prompt stays a prefix-cache hit, as in the user's traffic) and no two share more than
    their rows' longest shared prefix and a character or two of tag."""
    system = "You are a careful miller. Answer in one sentence.\n\n"
    rows = [system + f"Question about {w}: why?" for w in ("grain", "water", "stone", "wheel", "flour", "river")]
    rows += [r["prompt"] for r in synthetic("mixed", 6, seed=9)]
    cut = dict(zip(rows, shared_prefixes(rows), strict=True))
    assert cut[rows[0]] == len(system + "Question about ")
    reqs, varied = PromptSets(write_jsonl(tmp_path / "w.jsonl", rows), 3, seed=0).take(200, 1.0, 0)
    prompts = [r["prompt"] for r in reqs]
    assert varied == 196 and len(set(prompts)) == 200

    def origin(p: str) -> str:  # the row a prompt is, or is a copy of (its tag, 7 characters, taken out)
        return next(r for r in cut if p == r or p[: cut[r]] + p[cut[r] + 7 :] == r)

    for p in prompts:
        row = origin(p)
        if row.startswith(system):
            assert p.startswith(system + "Question about ")
    for x, y in combinations(prompts, 2):
        bound = max(cut[origin(x)], cut[origin(y)]) + 2
        assert len(os.path.commonprefix([x, y])) <= bound


def tune_args(tmp_path, workload: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(
        [
            "--slo", "ttft_p99=3s,tpot_p99=150ms",
            "--price-per-hour", "0.1",
            "--workload", workload,
            "--candidate", "seqs 8=--max-num-seqs 8",
            "--serve-args=--no-such-flag",  # any server tune started would exit at once
            "--time-budget", "1",
            "--output-dir", str(tmp_path),
        ]
    )  # fmt: skip


@pytest.mark.parametrize(
    "lines, said",
    [
        (['{"prompt": "one"}', '{"prompt": "two"}'], "2 prompt(s), but 3 disjoint prompt sets need at least 3"),
        (['{"prompt": "one"}', '{"text": "two"}'], "w.jsonl:2: expected a JSON object with a prompt"),
        (['{"prompt": "one"', ""], "w.jsonl:1: expected a JSON object"),
    ],
)
def test_a_workload_file_tune_cannot_use_is_said_before_any_server_starts(tmp_path, capsys, lines, said):
    path = tmp_path / "w.jsonl"
    if lines is not None:
        path.write_text("\n".join(lines) + "\n")
    assert tune_run(tune_args(tmp_path, str(path))) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --workload ") and said in err
    assert not (tmp_path / "tune.json").exists()


def test_a_new_server_gets_the_same_sets_from_the_start_without_reading_the_file_again(tmp_path):
    path = write_jsonl(tmp_path / "w.jsonl", [f"Question {i}: why?" for i in range(9)])
    first = PromptSets(path, 3, seed=0)
    sent = first.take(3, 1.0, 0)[0]
    Path(path).unlink()  # a second server's sets come from what was read
    second = first.for_server()
    assert second.take(3, 1.0, 0)[0] == sent
    assert first.take(3, 1.0, 0)[0] != sent  # the first server's stream goes on
