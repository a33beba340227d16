"""`tokenmill tune`: the server settings that meet a latency SLO at the lowest cost per token.

SLO first, tuning second. ``--slo ttft_p99=2s,tpot_p99=100ms`` names the limits (ttft, tpot,
itl or e2e at mean, p50, p90 or p99). A candidate is a set of `tokenmill serve` flags
(batch size, step token budget, KV dtype, speculation, quantisation); for each, a server is
started and `bench serve`'s load is sent at rising request rates until the SLO breaks. What a
candidate is worth is the highest rate at which it met the SLO (its goodput) and the cost of
a million output tokens there: ``--price-per-hour`` times the run's duration over its
tokens, so a candidate that sustains more traffic on the same machine costs less per token;
joules per token come from the server's /metrics (measured or estimated, as it says).

Successive halving instead of a grid: every candidate gets a short probe at each rate
(``--seconds`` of arrivals, so ``rate x seconds`` requests: a round measured by prompt count
ran for a second at a high rate and saw none of the queue that builds near capacity); the
better half is measured again for twice the seconds, from its best rate (down where the
longer run breaks it); and so on (``--rounds``, 2 by default: two rounds and the validation
fit 15 minutes on a 2-core machine). The defaults are measured in every round beside the
others. A run stops as soon as its SLO is certainly broken (``doomed``: enough requests
already over a limit), so that a rate too high costs seconds, not the whole drain of its
queue.

Short runs still flatter a rate near capacity, so what the report states comes from a last
**validation**: the pick and the defaults, each in a fresh server, for ``--validate-seconds``
at the rate the search found with each of ``--validate-sets`` prompt sets none of the search
saw (2: the worst decides), against the SLO tightened by ``--validation-margin`` (10%: a p99
over a minute's requests is one or two requests' luck, and which prompts arrive together is
another: at 1 req/s the default model's TTFT p99 was 1.7-1.8 s with one set and 2.2-2.4 s
with another); a rate that fails with any set is stepped down until one meets it with all.
A workload file's rows are dealt into the search's set and each validation set's, and no
server is sent a prompt twice: a run that needs more than its set's rows gets them again
varied (``loadgen.prompt_sets``), since a repeat is a prefix-cache hit the user's traffic
would not have (cycled, 64 rows made three quarters of a run's requests hits, and the
validated rate missed the SLO on the user's own prompts).
The search's pick must be cheaper than the defaults by ``--min-gain`` (5%) to be validated
at all: candidates that meet the SLO at the same rate cost the same (the rate sets the
cost), and their order is noise. The defaults are validated after the pick only as far as
beating it needs (``defaults_ladder``). The pick is named only if its validated cost beats
the defaults' validated cost; otherwise the defaults are (or, if neither validates, nothing).
"""
