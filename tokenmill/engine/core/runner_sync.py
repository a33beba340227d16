"""What the model runner holds, and the one place that builds the deltas keeping it so.

The runner keeps per-request state between steps (token ids, block table, sampling state,
a seeded generator), so each step tells it only what changed: requests it has not seen
(whole), block-table entries it lacks (``BlockTable.unsynced``), and requests to drop
(finished or aborted; preempted, whose generator it keeps until the request ends).
``RunnerSync`` owns "which requests the runner knows"; the scheduler reports each request
it lets go of (``forget``) and asks for each step's ``model_input``.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.engine.core.request import Request
from tokenmill.engine.model_input import CachedRequestData, ModelInput, NewRequestData, ScheduledTokens


class RunnerSync:
    def __init__(self) -> None:
        self._known: set[str] = set()  # requests whose state the runner holds
        self._finished: list[str] = []  # to drop at the next call
        self._preempted: list[str] = []  # likewise, keeping their generators

    def forget(self, req: Request, preempted: bool = False) -> None:
        """The scheduler let go of ``req`` (finished, aborted or preempted)."""
        rid = req.request_id
        if rid in self._known:
            self._known.discard(rid)
            (self._preempted if preempted else self._finished).append(rid)
        elif not preempted and req.num_preemptions:
            self._finished.append(rid)  # the runner keeps a preempted request's generator until it ends

    def model_input(
        self,
        scheduled: list[tuple[Request, int, list[int], int]],
        block_copies: list[tuple[int, int]],
        runner_table: Callable[[Request], list[int]],
    ) -> ModelInput:
        """The step as the runner sees it, for ``scheduled`` (request, new tokens, draft
        tokens, lookahead slots): deltas against what it already holds, and the drops."""
        batch = self.drops()
        batch.block_copies = block_copies
        for req, num_new, spec_token_ids, num_lookahead in scheduled:
            rid = req.request_id
            if rid not in self._known:
                self._known.add(rid)
                batch.new_requests.append(
                    NewRequestData(
                        rid,
                        req.prompt_token_ids,
                        list(req.output_token_ids),
                        req.params,
                        runner_table(req),
                        req.lora_name,
                        req.pooling,
                    )
                )
            elif (delta := req.block_ids.unsynced()) is not None:
                batch.cached_requests.append(CachedRequestData(rid, *delta))
            req.block_ids.mark_synced()
            batch.scheduled.append(
                ScheduledTokens(
                    rid, req.num_computed_tokens, num_new, spec_token_ids, num_lookahead, req.num_evicted_tokens
                )
            )
        return batch

    def drops(self) -> ModelInput:
        """Only the requests to drop since the runner was last told (an idle engine's last call)."""
        batch = ModelInput(finished_request_ids=self._finished, preempted_request_ids=self._preempted)
        self._finished, self._preempted = [], []
        return batch
