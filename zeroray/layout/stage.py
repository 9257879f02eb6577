"""The ZeRO stage as a policy on units: what stays gathered, how gradients are reduced.

[Note: stage policy]
Every stage runs the same step over the same unit objects (fetch/unit.py); the stage only
chooses these four answers, taken once when the engine is built:

stage | full params between uses | local param shard | gradient reduction | reduced every micro-batch
0     | kept (the arena)         | none              | all-reduce         | no: last micro-batch only
1     | kept (the arena)         | yes: gather source| reduce-scatter     | no: last micro-batch only
2     | kept (the arena)         | yes: gather source| reduce-scatter     | yes
3     | freed after use          | yes: the params   | reduce-scatter     | yes

Stage 1 reduce-scatters rather than all-reduces: its owner only needs its slice of the
reduced gradient, and reduce-scatter plus the all-gather of the updated parameters moves
what one all-reduce moves (the paper's 2Φ). What sets stage 1 apart from stage 2 is
gradient accumulation: stage 1 lets autograd accumulate full local gradients over the
micro-batches and reduces once; stage 2 reduce-scatters every micro-batch into the shard.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class ReduceMode(enum.Enum):
    ALL_REDUCE = "all_reduce"          # every rank keeps the full reduced gradient
    REDUCE_SCATTER = "reduce_scatter"  # every rank keeps the slice it owns


@dataclass(frozen=True)
class StagePolicy:
    stage: int
    reshard_after_use: bool           # units are gathered before use and freed after (stage 3)
    keeps_param_shard: bool           # a local parameter shard exists and units are gathered from it
    reduce: ReduceMode
    reduce_every_micro_batch: bool    # else autograd accumulates full grads; reduce on the last one

    @classmethod
    def for_stage(cls, stage: int) -> "StagePolicy":
        return cls(stage=stage, reshard_after_use=stage == 3, keeps_param_shard=stage >= 1,
                   reduce=ReduceMode.ALL_REDUCE if stage == 0 else ReduceMode.REDUCE_SCATTER,
                   reduce_every_micro_batch=stage >= 2)
