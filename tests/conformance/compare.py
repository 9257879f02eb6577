"""The tolerance rule: when a zeroray run of a case agrees with the oracle, and what differs first.

fp32 (the project's parity bound, as tests/dist/test_engine_parity.py):
  - each step's global loss within 1e-5 relative of the oracle's;
  - each step's global gradient norm (before clipping) within 1e-4 relative;
  - every trained and frozen parameter within 1e-5 absolute after the last step;
  - buffers (worker 0's, see oracle.py) within 1e-5 absolute, integer ones equal. Not
    compared with activation checkpointing: recomputing a BatchNorm's forward in backward
    updates its running statistics a second time (torch.utils.checkpoint does so in plain
    PyTorch too), so they legitimately differ from the oracle's.
  AdamW runs with eps=1e-3, not the 1e-5 of tests/dist/test_real_models.py (nor the default
  1e-8): some gradients are exactly zero in exact arithmetic, so the computed ones are
  rounding noise, which Adam divides by ~(|noise| + eps) and turns into real updates that
  differ between any two runs whose float operations are ordered differently (DDP's too).
  Here that is not only nn.MultiheadAttention's key bias (softmax is shift-invariant, noise
  ~1e-10) but every per-channel bias or scale right before a BatchNorm (BatchNorm removes
  each channel's mean and scale), whose noise BatchNorm's 1/sqrt(var + eps) amplifies over a
  micro-batch of 2 tokens: 1e-6 with BatchNorm's default eps (a frozen Linear's bias drifted
  1.7e-5 from the oracle in 4 steps at Adam eps 1e-5, and 5e-5 in 3 steps at 1e-3), ~1e-8
  with the grammar's eps=0.1 (grammar.py). At Adam eps 1e-3 such noise moves a parameter
  ~lr·1e-5 per step. Real gradients here are ~1e-3..1e-1, so Adam still normalises them,
  and a larger eps makes the update more sensitive to a wrongly scaled gradient, not less
  (at a tiny eps Adam's update is blind to the gradient's scale).
  The optimizer's path is the one zeroray takes for it: whole parameters for recipe.WHOLE_PARAM,
  flat pieces for the rest ([Note: optimizer paths] in zeroray/engine/optim_choice.py).
  torch.optim.Muon (recipe.REORDER_BOUND) rounds its Newton-Schulz iteration in bf16, so a
  gradient's last-bit difference under another summation order moves its update: a muon case's
  bound for each quantity is the larger of the one above and twice the oracle's own spread under
  reordering (oracle.reorder_spread), as tests/dist/test_whole_param_optim.py bounds torch's Muon.
  LAMB (the tests' own, tests/whole_param_optimizers.py) is bounded the same way: its trust ratio
  scales each tensor's update to lr·||w|| whatever the gradient's size, so a parameter whose
  gradient is zero in exact arithmetic (a bias right before a BatchNorm: rounding noise of 1e-9)
  moves by lr·||w|| in the direction of that noise, which any other summation order redraws.
  Fuzz seed 1796672417 (one worker, stage 0, clipping at 0.05): the oracle moved such a bias by
  2.2e-3 against itself when only its clip norm was summed in another order, and zeroray by the
  same 2.2e-3; every loss and gradient norm agreed to the fp32 rule.
bf16 and fp16 compute, or reductions (reduce_dtype; configs.RunConfig.precision), against
the fp32 oracle (the master weights are fp32, compute or reductions are not):
  - each step's global loss within 2% (bf16) or 0.5% (fp16) relative of the fp32 oracle's,
    and finite; the same for the evaluate call's loss;
  - no step skipped (fp16 starts at loss scale 2**10, configs.py, which these models' gradients
    never overflow: a skip would leave the run a step behind the oracle, which does not skip).
  These cases train at lr 5e-2 (configs.LOWP_LR) on learnable targets (data.py), so that a
  step moves the loss far more than rounding does. Measured on 50 such cases (one worker,
  steps 1-3 of 3-4): bf16 differs from the fp32 oracle by 0.03% (median), 0.14% (90th
  percentile), 0.86% at most; fp16 by 0.005%, 0.02%, 0.08%. Bugs move it further: dropping
  one micro-batch's gradient by 1.4% (median; > 2% in 8 of 19 cases), half the learning rate
  by 6% (> 2% in 45 of 50), leaving the first block's parameters unchanged by 1.9% (> 2% in
  28 of 50); at lr 1e-2 on random targets (bf16 0.2% at most) those were 0.3%, 0.5% and 0.2%,
  which is why the loss alone would not have meant much there. Each bound is ~2.5x (bf16)
  and ~6x (fp16) the largest deviation measured; the fp32 rule catches what is smaller.
  Parameters are not compared: a bf16 gradient's rounding flips the sign of Adam's update
  of its small elements, a difference of 2·lr per step in those elements.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from tests.conformance.case import Case
from tests.conformance.oracle import Reference
from tests.conformance.recipe import WHOLE_PARAM
from tests.conformance.runner import RankResults

FP32_LOSS_REL = 1e-5
FP32_NORM_REL = 1e-4
FP32_PARAM_ABS = 1e-5
LOWP_LOSS_REL = {"bf16": 2e-2, "fp16": 5e-3}
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)(:|$)")


@dataclass
class Verdict:
    ok: bool
    kind: str = ""        # one line: the error type, or the first differing quantity
    detail: str = ""      # the traceback or the numbers
    worst: float = 0.0    # the largest relative loss deviation seen (for reports)


@dataclass(frozen=True)
class Bounds:
    """The fp32 rule's bounds for one case (the module docstring)."""
    loss: float = FP32_LOSS_REL
    norm: float = FP32_NORM_REL
    param: float = FP32_PARAM_ABS
    eval_loss: float = FP32_LOSS_REL
    eval_output: float = FP32_PARAM_ABS

    @classmethod
    def from_spread(cls, spread: Optional[Dict[str, float]]) -> "Bounds":
        """Twice the oracle's own spread under reordering, never below the fp32 rule's bounds."""
        if not spread:
            return cls()
        return cls(max(FP32_LOSS_REL, 2 * spread["loss"]), max(FP32_NORM_REL, 2 * spread["norm"]),
                   max(FP32_PARAM_ABS, 2 * spread["state"]), max(FP32_LOSS_REL, 2 * spread["eval_loss"]),
                   max(FP32_PARAM_ABS, 2 * spread["eval_output"]))


def judge(case: Case, ref: Optional[Reference], got: RankResults, oracle_error: Optional[str] = None,
          spread: Optional[Dict[str, float]] = None) -> Verdict:
    """``spread``: the oracle's own under reordering (oracle.reorder_spread), for the optimizers
    bounded by it."""
    if oracle_error is not None:
        return Verdict(False, f"oracle: {_first_line(oracle_error)}", oracle_error)
    if got.error is not None:
        return Verdict(False, _error_kind(got.error.split("\nrank ")[0]), got.error)  # the first rank's: the cause
    losses = got.losses
    worst = max((abs(a - b) / abs(b) for a, b in zip(losses, ref.losses)), default=0.0)
    whole = case.config.optimizer in WHOLE_PARAM
    paths = {r["whole_params"] for r in got.per_rank}
    if paths != {whole}:
        verdict = Verdict(False, f"optimizer path: whole_params {sorted(paths)} for {case.config.optimizer}")
    elif case.config.precision == "fp32":
        verdict = _fp32(case, ref, got, losses, Bounds.from_spread(spread))
    else:
        verdict = _lowp(case, ref, got, losses)
    verdict.worst = worst
    return verdict


def _fp32(case: Case, ref: Reference, got: RankResults, losses, bounds: Bounds) -> Verdict:
    for step, (a, b) in enumerate(zip(losses, ref.losses)):
        if not abs(a - b) <= bounds.loss * abs(b):
            return Verdict(False, f"loss differs at step {step}",
                           f"{a!r} vs oracle {b!r} (rel {abs(a - b) / abs(b):.2e})")
    norms = got.per_rank[0]["norms"]
    for step, (a, b) in enumerate(zip(norms, ref.norms)):
        if not abs(a - b) <= bounds.norm * abs(b):
            return Verdict(False, f"grad norm differs at step {step}", f"{a!r} vs oracle {b!r}")
    skip_buffers = bool(case.config.zero.get("activation_checkpointing"))
    buffer_names = set(ref.state) - set(ref.param_names)
    for name, want in ref.state.items():
        if name in buffer_names and skip_buffers:
            continue
        if name not in got.params:
            return Verdict(False, f"state {name} missing", "")
        have = got.params[name].reshape(want.shape)
        if not want.is_floating_point():
            if not torch.equal(have.to(want.dtype), want):
                return Verdict(False, f"buffer {name} differs", f"{have} vs oracle {want}")
            continue
        err = (have.to(want.dtype) - want).abs().max().item()
        if not err <= bounds.param:
            what = "buffer" if name in buffer_names else "param"
            return Verdict(False, f"{what} {name} differs", f"max abs diff {err:.2e}")
    if _eval_comparable(case):
        return _eval(ref, got, bounds.eval_loss, outputs=bounds.eval_output)
    return Verdict(True)


def _eval_comparable(case: Case) -> bool:
    """Evaluation after training is compared, except where a BatchNorm's running statistics (which
    eval mode uses) were legitimately updated twice per step by activation checkpointing."""
    return case.evaluate and not (case.config.zero.get("activation_checkpointing") and "bn" in case.model.blocks)


def _eval(ref: Reference, got: RankResults, rel: float, outputs: Optional[float]) -> Verdict:
    """The evaluate call's loss (the mean over workers) and, with ``outputs`` (their absolute
    bound), the run call's logits, per worker."""
    ranks = got.per_rank
    a, b = sum(r["eval_loss"] for r in ranks) / len(ranks), sum(ref.eval_losses) / len(ref.eval_losses)
    if not (math.isfinite(a) and abs(a - b) <= rel * abs(b)):
        return Verdict(False, "eval loss differs", f"{a!r} vs oracle {b!r} (rel {abs(a - b) / abs(b):.2e})")
    for rank, (r, want) in enumerate(zip(ranks, ref.eval_outputs)) if outputs else ():
        have = r["eval_output"]
        if have.shape != want.shape:
            return Verdict(False, "run output shape differs",
                           f"rank {rank}: {tuple(have.shape)} vs {tuple(want.shape)}")
        err = (have.float() - want).abs().max().item()
        if not err <= outputs:
            return Verdict(False, "run output differs", f"rank {rank}: max abs diff {err:.2e}")
    return Verdict(True)


def _lowp(case: Case, ref: Reference, got: RankResults, losses) -> Verdict:
    bound = LOWP_LOSS_REL[case.config.precision]
    skipped = got.per_rank[0]["skipped"]
    if any(skipped):
        return Verdict(False, "fp16 step skipped", f"skipped: {skipped}")
    for step, (a, b) in enumerate(zip(losses, ref.losses)):
        if not (math.isfinite(a) and abs(a - b) <= bound * abs(b)):
            return Verdict(False, f"loss differs at step {step} (> {bound:.1%})",
                           f"{a!r} vs fp32 oracle {b!r} (rel {abs(a - b) / abs(b):.2e})")
    if _eval_comparable(case):
        return _eval(ref, got, bound, outputs=None)
    return Verdict(True)


def _error_kind(text: str) -> str:
    """The exception's type and the first line of its message, from a traceback."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            return line[:160]
    return lines[-1][:160] if lines else "error"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""
