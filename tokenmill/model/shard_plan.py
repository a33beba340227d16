"""Which part of the model one rank holds (``ModelShard``); ``model/shard_weights.py`` cuts a
whole model to it.

Tensor parallelism (Megatron-style) splits each layer across the ``tp_size`` ranks of
a stage: the fused QKV and gate-up projections by output rows (column-parallel: each
rank owns whole attention heads and a slice of the MLP's intermediate columns), the
o and down projections by input columns (row-parallel: partial sums, added by an
all-reduce), the embedding and LM head by vocabulary rows (each rank looks up the ids
it owns; logits are gathered). When there are fewer KV heads than ranks, each KV
head is replicated on the ranks whose query heads read it.

Pipeline parallelism gives each of ``pp_size`` stages a contiguous run of layers: the
first stage also holds the embedding, the last the final norm and the LM head.

"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenmill.configuration.config import ModelConfig
from tokenmill.errors import TokenmillError


@dataclass(frozen=True)
class ModelShard:
    """One rank's part: its tensor-parallel rank within its stage, and its stage."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def is_whole(self) -> bool:
        return self.tp_size == 1 and self.pp_size == 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def rank(self) -> int:
        """Global rank: stage-major, so a stage's TP group is consecutive ranks."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @classmethod
    def of_rank(cls, rank: int, tp_size: int, pp_size: int) -> ModelShard:
        return cls(rank % tp_size, tp_size, rank // tp_size, pp_size)

    def layers(self, cfg: ModelConfig) -> range:
        per = cfg.num_layers // self.pp_size
        return range(self.pp_rank * per, (self.pp_rank + 1) * per)

    def q_heads(self, cfg: ModelConfig) -> range:
        per = cfg.num_heads // self.tp_size
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)

    def kv_heads(self, cfg: ModelConfig) -> range:
        if cfg.num_kv_heads >= self.tp_size:
            per = cfg.num_kv_heads // self.tp_size
            return range(self.tp_rank * per, (self.tp_rank + 1) * per)
        head = self.tp_rank * cfg.num_kv_heads // self.tp_size  # the one KV head this rank's queries read
        return range(head, head + 1)

    def intermediate(self, cfg: ModelConfig) -> range:
        per = cfg.intermediate_size // self.tp_size
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)

    def vocab(self, cfg: ModelConfig) -> range:
        """Vocabulary rows this rank owns; every rank owns ``ceil(V / tp)`` (the last
        one's tail past V is zero padding, cut off after the logits are gathered)."""
        per = -(-cfg.vocab_size // self.tp_size)
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes this rank's tensors have: its heads, columns, vocabulary rows and
        layers. A pipeline stage's LM head is its own tensor (the embedding it may be
        tied to lives on the first stage)."""
        if self.is_whole:
            return cfg
        return dataclasses.replace(
            cfg,
            num_layers=len(self.layers(cfg)),
            num_heads=len(self.q_heads(cfg)),
            num_kv_heads=len(self.kv_heads(cfg)),
            intermediate_size=len(self.intermediate(cfg)),
            vocab_size=len(self.vocab(cfg)),
            tie_word_embeddings=cfg.tie_word_embeddings and self.pp_size == 1,
            layer_windows=None if cfg.layer_windows is None else tuple(cfg.layer_windows[i] for i in self.layers(cfg)),
        )


def check_parallel_sizes(cfg: ModelConfig, tp: int, pp: int) -> None:
    """Refuse sizes that do not split this model, naming the numbers."""
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"tensor_parallel_size {tp} does not divide the {cfg.num_heads} attention heads")
    elif cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        problems.append(f"tensor_parallel_size {tp} and the {cfg.num_kv_heads} KV heads: one must divide the other")
    if cfg.intermediate_size % tp:
        problems.append(f"tensor_parallel_size {tp} does not divide the MLP's {cfg.intermediate_size} columns")
    if cfg.num_layers % pp:
        problems.append(f"pipeline_parallel_size {pp} does not divide the {cfg.num_layers} layers")
    if problems:
        divisors = [
            d
            for d in range(1, cfg.num_heads + 1)
            if not cfg.num_heads % d
            and not cfg.intermediate_size % d
            and not (cfg.num_kv_heads % d and d % cfg.num_kv_heads)
        ]
        layers = [d for d in range(1, cfg.num_layers + 1) if not cfg.num_layers % d]
        raise TokenmillError(
            "; ".join(problems) + f" (this model splits with tensor_parallel_size in {divisors} "
            f"and pipeline_parallel_size in {layers})"
        )
