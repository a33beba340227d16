"""Prompt lookup: the latest earlier match of the longest suffix, token-aligned."""

from __future__ import annotations

from tokenmill.sampling_params import SamplingParams
from tokenmill.speculative.ngram import NgramProposer, lookup
from tokenmill.worker.inputs import SeqInput


def test_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    history = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 8, 2, 3, 4]
    assert lookup(history, k=3, max_n=3, min_n=1) == [6, 7, 8]  # [2,3,4] last seen before 6
    assert lookup(history, k=10, max_n=3, min_n=1) == [6, 7, 8, 2, 3, 4]  # runs up to the end


def test_falls_back_to_shorter_suffixes_and_gives_up_below_min():
    history = [7, 1, 8, 2, 9, 1]
    assert lookup(history, k=2, max_n=3, min_n=1) == [8, 2]  # only the 1-gram [1] matches
    assert lookup(history, k=2, max_n=3, min_n=2) == []
    assert lookup([1, 2, 3], k=2, max_n=3, min_n=1) == []
    assert lookup([5], k=2, max_n=3, min_n=1) == []


def test_matches_are_aligned_on_whole_tokens():
    # 256 = bytes 00 01 00 00 and 1 = 01 00 00 00: the byte string of [256, 0] contains
    # that of [1] at an unaligned offset; only the real earlier 1 may match.
    history = [256, 0, 5, 1, 6, 1]
    assert lookup(history, k=1, max_n=1, min_n=1) == [6]
    assert lookup([256, 0, 1], k=1, max_n=1, min_n=1) == []


def test_proposer_uses_prompt_output_and_this_steps_tokens_and_respects_lookahead():
    s = SeqInput("r", [4], 5, [0, 1], True, SamplingParams(), prompt_ids=[1, 2, 3, 4, 1, 2], output_ids=[3])
    s.num_lookahead = 2
    prop = NgramProposer(max_n=3, min_n=1)
    drafts = prop.propose([s], {"r": [4]}, lambda rid, seed: None)
    assert drafts["r"].token_ids == [1, 2] and drafts["r"].probs is None  # [2,3,4] -> 1 2 (3 4 cut by k)
    s.num_lookahead = 0
    assert prop.propose([s], {"r": [4]}, lambda rid, seed: None) == {}
