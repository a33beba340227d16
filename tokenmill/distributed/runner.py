"""The driver's model runner for a split model (rank 0).

It is the ordinary ``ModelRunner`` (request state, sampling, prompt-lookup drafts,
all on the driver) whose forward is this rank's part of the pipeline, plus one
broadcast per step: the step's record and what the driver sampled the step before,
so that every worker keeps the same request state without ever sampling.

A failure inside the forward cannot be retried request by request here (the other
ranks are in the middle of the same collectives), so it ends the engine
(``EngineDeadError``, naming the rank and the reason) and stops the workers.
Sampling happens after every collective of the step: its failures are retried as
on one process.
"""

from __future__ import annotations

import torch

from tokenmill.distributed.cluster import Cluster
from tokenmill.distributed.rank_messages import Committed, Forward, ScoredSeq, Step
from tokenmill.engine.model_input import GrammarMasks, ModelInput, ModelOutput
from tokenmill.errors import EngineDeadError
from tokenmill.worker.inputs import SeqInput
from tokenmill.worker.model_runner import ModelRunner


class DistributedRunner(ModelRunner):
    scores_prompts = False  # every rank runs the same forward: no per-request extra rows

    def __init__(self, *args, cluster: Cluster, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cluster = cluster
        self._committed: Committed = {}  # sampled last step, not yet told to the workers

    def execute(self, batch: ModelInput, grammar: GrammarMasks | None = None) -> ModelOutput:
        self.cluster.broadcast(Step(batch, self._committed))  # the masks stay here: only the driver samples
        self._committed = {}
        out = super().execute(batch, grammar)
        for s in batch.scheduled:
            rid = s.request_id
            self._committed[rid] = ([t.token_id for t in out.sampled.get(rid, [])], out.draft_token_ids.get(rid))
        return out

    def compute_logits(self, seqs: list[SeqInput]) -> torch.Tensor:
        try:
            return super().compute_logits(seqs)
        except EngineDeadError:
            raise
        except Exception as e:
            raise self.cluster.failure(e, "during a forward") from e

    @torch.inference_mode()
    def all_logits(self, seqs: list[SeqInput]) -> torch.Tensor:
        self.cluster.broadcast(Forward([ScoredSeq.of(s) for s in seqs]))
        try:
            return super().all_logits(seqs)
        except Exception as e:
            raise self.cluster.failure(e, "during a forward") from e

    def close(self) -> None:
        self.cluster.shutdown()
