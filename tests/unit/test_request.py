"""Request.token_ids_slice equals slicing prompt + output, across the boundary."""

from tokenmill.engine.core.request import Request
from tokenmill.sampling_params import SamplingParams


def test_token_ids_slice_matches_all_token_ids():
    r = Request("r", [1, 2, 3, 4], SamplingParams(), output_token_ids=[5, 6, 7])
    for start in range(8):
        for end in range(start + 1, 9):
            assert r.token_ids_slice(start, end) == r.all_token_ids[start:end]
