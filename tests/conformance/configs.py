"""The fuzzer's run configurations: workers, steps, rows, and a random ZeroConfig.

Every knob of ``zeroray/config.py`` that changes how a step is computed, not what it computes
(so the oracle is the same for all of them): stage, dtype, gradient accumulation, clipping,
wrap policy, stage-3 prefetch and its window, reuse distance and live bound, bucket sizes
(small ones force many buckets, a parameter split over several), the planned bucket flush
timeout and "auto" buckets, activation checkpointing and offload, sharded construction,
cast_buffers, reduce_dtype; wrap and activation checkpointing given as classes or a callable
(``sample_extras``). Outside ZeroConfig: parameter groups (no weight decay on biases and
normalisation, half the learning rate on the embedding) and a warm-up LR scheduler. The
optimizer (``sample_recipe``, recipe.py) is AdamW with the hyperparameters below (compare.py
says why eps is 1e-3 and why cases with bf16/fp16 compute or reductions train at a larger
learning rate) or one of recipe.OPTIMIZERS; offload="disk" is drawn with it.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-3)
# bf16/fp16 cases are compared by their losses only (compare.py), so their steps should move
# the loss far more than rounding does: 5x the learning rate (measured there).
LOWP_LR = 5e-2
# fp16's first loss scale: the default 2**16 overflows on the first steps of many of these tiny
# models, and a skipped step has no counterpart in the fp32 oracle (compare.py: a skip fails).
FP16_LOSS_SCALE = 2.0 ** 10


def param_groups(name: str, param) -> dict:
    """The cases' parameter groups (Engine's ``param_groups`` callback; the oracle builds the
    same torch groups from it)."""
    if name.endswith("bias") or ".ln." in name or ".bn." in name:
        return {"weight_decay": 0.0}
    if name == "emb.weight":
        return {"lr": ADAMW["lr"] / 2}  # relative to the case's own rate: see RunConfig.groups
    return {}


def _warmup_factor(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def warmup(optimizer):
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_factor)


@dataclass(frozen=True)
class RunConfig:
    world: int
    steps: int
    rows: int                      # rows per micro-batch per worker
    zero: Dict[str, Any] = field(default_factory=dict)  # ZeroConfig keyword arguments
    groups: bool = False           # parameter groups (param_groups)
    scheduler: bool = False        # the warm-up scheduler (warmup)
    optimizer: str = "adamw"       # one of recipe.OPTIMIZERS

    @property
    def accum(self) -> int:
        return self.zero.get("grad_accum_steps", 1)

    @property
    def dtype(self) -> str:
        return self.zero.get("dtype", "fp32")

    @property
    def precision(self) -> str:
        """The lowest precision the step computes or reduces in: what compare.py judges by."""
        reduce = self.zero.get("reduce_dtype") or "fp32"
        return self.dtype if self.dtype != "fp32" else reduce

    @property
    def adamw(self) -> Dict[str, float]:
        """AdamW's hyperparameters for this case (engine, oracle and DDP alike)."""
        return ADAMW if self.precision == "fp32" else {**ADAMW, "lr": LOWP_LR}

    def group_overrides(self, name: str, param) -> dict:
        """``param_groups(name, param)`` at this case's optimizer's learning rate."""
        from tests.conformance.recipe import lr_of

        out = param_groups(name, param)
        if "lr" in out:
            out["lr"] = out["lr"] / ADAMW["lr"] * lr_of(self.optimizer, self.adamw)
        return out

    def engine_optimizer(self):
        """What the engine is given for this case's optimizer (recipe.py)."""
        from tests.conformance.recipe import engine_optimizer

        return engine_optimizer(self.optimizer, self.adamw)

    @property
    def global_rows(self) -> int:
        return self.world * self.accum * self.rows

    def zero_config(self):
        import zeroray as zr

        return zr.ZeroConfig(**self.zero)

    def describe(self) -> str:
        knobs = " ".join(f"{k}={_show(v)}" for k, v in self.zero.items() if k != "stage")
        extra = (" param_groups" if self.groups else "") + (" warmup" if self.scheduler else "")
        extra += f" optimizer={self.optimizer}" if self.optimizer != "adamw" else ""
        return f"W{self.world} stage{self.zero['stage']} steps={self.steps} rows={self.rows} {knobs}".rstrip() + extra


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ",".join(getattr(v, "__name__", str(v)) for v in value) + ")"
    return getattr(value, "__name__", None) or str(value)


def sample_config(rng: random.Random, *, dtypes=("fp32", "bf16", "fp16"), max_world: int = 3) -> RunConfig:
    stage = rng.randint(0, 3)
    zero: Dict[str, Any] = {"stage": stage}
    dtype = rng.choice(dtypes) if rng.random() < 0.4 else "fp32"
    if dtype != "fp32":
        zero["dtype"] = dtype
        if rng.random() < 0.3:
            zero["cast_buffers"] = True
        if dtype == "fp16":
            zero["initial_loss_scale"] = FP16_LOSS_SCALE
    if rng.random() < 0.35:
        zero["grad_accum_steps"] = 2
    if rng.random() < 0.35:
        zero["max_grad_norm"] = rng.choice((0.05, 1.0))
    if rng.random() < 0.5:
        zero["wrap"] = "module"
    buckets = rng.random()
    if buckets < 0.35:
        zero["bucket_bytes"] = rng.choice((16, 40, 64, 256))
    elif buckets < 0.45:
        zero["bucket_bytes"] = "auto"
    elif buckets < 0.55:
        zero["bucket_timeout_ms"] = rng.choice((0.01, 1.0))
    if stage == 3:
        if rng.random() < 0.3:
            zero["prefetch"] = False
        if rng.random() < 0.3:
            zero["prefetch_bytes"] = rng.choice((64, 256))
        if rng.random() < 0.25:
            zero["reuse_distance"] = 0
        if rng.random() < 0.15:
            zero["max_live_bytes"] = 200
        if rng.random() < 0.15:
            zero["sharded_init"] = False
    if rng.random() < 0.15:
        zero["activation_checkpointing"] = True
        if rng.random() < 0.3:
            zero["offload_activations"] = True
    return RunConfig(world=rng.randint(1, max_world), steps=rng.randint(2, 4), rows=rng.randint(1, 3), zero=zero)


def with_rows_at_least(config: RunConfig, rows: Optional[int]) -> RunConfig:
    """The same config with enough rows per part that the global batch holds ``rows`` rows."""
    if rows is None or config.global_rows >= rows:
        return config
    per = -(-rows // (config.world * config.accum))
    return dataclasses.replace(config, rows=per)


def sample_extras(rng: random.Random, config: RunConfig) -> RunConfig:
    """More knobs, drawn after everything else of a case (so adding them changed no batch):
    reduce_dtype, wrap and activation checkpointing as classes or a callable, parameter groups,
    the warm-up scheduler."""
    from tests.conformance import grammar

    zero = dict(config.zero)
    if rng.random() < 0.2:
        zero["reduce_dtype"] = rng.choice(("fp32", config.dtype)) if config.dtype != "fp32" else "bf16"
    wrap = rng.random()
    if wrap < 0.1:
        zero["wrap"] = (grammar.Residual, grammar.Attention, grammar.Route)
    elif wrap < 0.2:
        zero["wrap"] = grammar.wrap_blocks
    if zero.get("activation_checkpointing") and rng.random() < 0.4:
        zero["activation_checkpointing"] = (grammar.Residual, grammar.Conv, grammar.Route)
    return dataclasses.replace(config, zero=zero, groups=rng.random() < 0.2, scheduler=rng.random() < 0.2)



def sample_recipe(rng: random.Random, config: RunConfig) -> RunConfig:
    """The optimizer and offload="disk" (issue 41), drawn after everything else of a case (so adding
    them changed no earlier draw). offload="disk" with a small chunk, so a step reads and writes
    the state in several chunks."""
    from tests.conformance.recipe import OPTIMIZERS

    optimizer = rng.choice(OPTIMIZERS)
    zero = dict(config.zero)
    if rng.random() < 0.2:
        zero["offload"] = "disk"
        zero["offload_chunk_bytes"] = rng.choice((256, 1024, 4096))  # 256: the smallest ZeroConfig takes
    return dataclasses.replace(config, zero=zero, optimizer=optimizer)
