"""The sharded optimizer: fp32 master shard, inner torch optimizer, global-norm clipping, loss scaler.

[Note: flat optimizer]
The inner ``torch.optim`` optimizer sees a few flat 1-D parameters, one per *segment*: a
run of the local shard whose elements share the same parameter-group overrides. Adam,
AdamW and SGD are elementwise, so updating a flat slice equals updating the parameters it
covers, and the optimizer state is a few contiguous tensors (M_D). Padding elements have
zero value and zero gradient and stay zero under these optimizers. An optimizer that mixes
elements (per-tensor norms, as in LAMB) would not match the unsharded run; see README.
When the master is not one tensor (stages 1-2 in fp32: the rank's rows of the parameter
arena, [Note: local shard] in local_shard.py), segments are also cut where its pieces
meet, one unit's slice each, so every segment is a view and the update lands in place.

The same class serves stage 0, where the "shard" is the whole model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from zeroray.local_shard import LocalShard


@dataclass(frozen=True)
class Segment:
    start: int
    end: int
    overrides: Tuple[Tuple[str, Any], ...]  # sorted items of the param-group overrides

    @property
    def key(self) -> str:
        return json.dumps(dict(self.overrides), sort_keys=True, default=str)


class LossScaleError(RuntimeError):
    pass


class LossScaler:
    """fp16 dynamic loss scaling; every rank holds the same state and sees the same overflow."""

    def __init__(self, initial: float, growth: float, backoff: float, interval: int, minimum: float) -> None:
        self.scale, self.growth, self.backoff, self.interval, self.minimum = initial, growth, backoff, interval, minimum
        self.good_steps = 0

    def update(self, overflow: bool, step: int) -> None:
        if overflow:
            new = self.scale * self.backoff
            if new < self.minimum:
                raise LossScaleError(
                    f"step {step}: gradients overflowed at loss scale {self.scale:g} and the scale would fall "
                    f"below min_loss_scale={self.minimum:g}. The fp16 range is too small for this model's "
                    "gradients: try dtype='bf16', a lower learning rate, gradient clipping (max_grad_norm), "
                    "or a smaller min_loss_scale.")
            self.scale = new
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % self.interval == 0:
                self.scale *= self.growth

    def state(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


def build_segments(spans: Sequence[Tuple[int, int, Dict[str, Any]]], total: int,
                   breaks: Sequence[int] = ()) -> List[Segment]:
    """Merge consecutive local spans with equal overrides; padding joins its neighbour. No
    segment crosses an offset in ``breaks`` (where a piece of the master starts)."""
    edges = [0, *sorted({b for b in breaks if 0 < b < total}), total]
    if len(edges) == 2:
        return _merge_spans(spans, total)
    segments: List[Segment] = []
    for lo, hi in zip(edges, edges[1:]):
        inside = [(a - lo, b - lo, o) for a, b, o in spans if lo <= a < hi]
        segments += [Segment(s.start + lo, s.end + lo, s.overrides) for s in _merge_spans(inside, hi - lo)]
    return segments


def _merge_spans(spans: Sequence[Tuple[int, int, Dict[str, Any]]], total: int) -> List[Segment]:
    segments: List[Segment] = []
    for start, end, overrides in spans:
        key = tuple(sorted(overrides.items()))
        if segments and segments[-1].overrides == key:
            prev = segments[-1]
            segments[-1] = Segment(prev.start, end, key)
        elif segments:
            prev = segments[-1]
            segments[-1] = Segment(prev.start, start, prev.overrides)  # absorb padding gap
            segments.append(Segment(start, end, key))
        else:
            segments.append(Segment(0, end, key))
    if not segments:
        return [Segment(0, total, ())] if total else []
    last = segments[-1]
    segments[-1] = Segment(last.start, total, last.overrides)
    return segments


class ShardedOptimizer:
    """An inner torch optimizer over this rank's flat fp32 master, by segments ([Note: flat
    optimizer]), with global-norm clipping and an optional LR scheduler."""

    def __init__(self, spec: Any, master: Union[torch.Tensor, LocalShard], grad: torch.Tensor,
                 segments: List[Segment], max_grad_norm: Optional[float],
                 scheduler_fn: Optional[Callable[[Any], Any]] = None) -> None:
        # 1D fp32 each; a LocalShard master is viewed one segment at a time ([Note: local shard])
        self.master, self.grad, self.segments = master, grad, segments
        self.max_grad_norm = max_grad_norm
        self.flat_params: List[torch.nn.Parameter] = []
        groups = []
        for seg in segments:
            p = torch.nn.Parameter(master[seg.start:seg.end])
            p.grad = grad[seg.start:seg.end]
            self.flat_params.append(p)
            groups.append({"params": [p], **dict(seg.overrides)})
        builder = spec.build if hasattr(spec, "build") else spec
        self.inner = builder(groups)
        if not isinstance(self.inner, torch.optim.Optimizer):
            raise ValueError(f"the optimizer spec returned {type(self.inner).__name__}, not a torch.optim.Optimizer: "
                             "pass zr.AdamW(...) or a callable params -> torch.optim.Optimizer")
        self.scheduler = scheduler_fn(self.inner) if scheduler_fn is not None else None

    def local_sumsq(self) -> torch.Tensor:
        """Squared L2 norm of this rank's (already averaged) gradient, a 0-dim fp32 tensor; the
        engine sums it over ranks in the step's status all-reduce."""
        # vector_norm, not pow(2).sum(): no gradient-sized temporary
        return torch.linalg.vector_norm(self.grad).square()

    def state_tensors(self) -> List[torch.Tensor]:
        """The inner optimizer's state tensors (momentum, variance, ...), for memory reports."""
        return [v for state in self.inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]

    def step(self, norm: float) -> None:
        """Clip by the global norm (as torch.nn.utils.clip_grad_norm_ does) and update."""
        if self.max_grad_norm is not None:
            coef = self.max_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                self.grad.mul_(coef)
        self.inner.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def skip(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()

    # --- state for checkpoints and resize: flat tensors over the local shard ----------------

    def export_state(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        tensors: Dict[str, torch.Tensor] = {}
        scalars: Dict[str, Any] = {}
        n = self.master.numel()
        keys: Dict[str, None] = {}
        for p in self.flat_params:
            for k, v in self.inner.state.get(p, {}).items():
                keys[k] = None
        for k in keys:
            vals = [self.inner.state.get(p, {}).get(k) for p in self.flat_params]
            if all(isinstance(v, torch.Tensor) and v.shape == p.shape for v, p in zip(vals, self.flat_params)):
                flat = torch.zeros(n, dtype=torch.float32)
                for seg, v in zip(self.segments, vals):
                    flat[seg.start:seg.end] = v.detach().float().cpu()
                tensors[f"optim.{k}"] = flat
            else:
                v = next((v for v in vals if v is not None), None)
                scalars[f"optim.{k}"] = float(v) if isinstance(v, (torch.Tensor, int, float)) else v
        scalars["group_lr"] = {seg.key: g["lr"] for seg, g in zip(self.segments, self.inner.param_groups)}
        if self.scheduler is not None:
            scalars["scheduler"] = {k: v for k, v in self.scheduler.state_dict().items()
                                    if isinstance(v, (int, float, bool, str))}
        return tensors, scalars

    def import_state(self, tensors: Dict[str, torch.Tensor], scalars: Dict[str, Any]) -> None:
        """Load what ``export_state`` produced (possibly resharded), through ``load_state_dict``.

        [Note: state placement]
        Each state tensor must end up where torch itself puts it, or the next ``step`` fails
        on a GPU: ``step`` stays a CPU float32 scalar unless the group is fused or capturable,
        then it goes to the parameter's device (fused Adam on CUDA refuses a CPU ``step``);
        every other tensor goes to the parameter's device and, the parameter being floating,
        its dtype. ``Optimizer.load_state_dict`` applies exactly that policy (and whatever an
        optimizer subclass changes in it), so the state is handed to it in CPU form instead of
        being written into ``inner.state`` by hand. Restore and resize both come through here.
        """
        sd = self.inner.state_dict()
        state: Dict[int, Dict[str, torch.Tensor]] = {}
        for index, seg in enumerate(self.segments):
            entry = {}
            for name, flat in tensors.items():
                if name.startswith("optim."):
                    # clone: load_state_dict's .to() is a no-op on a CPU run and would alias the caller's flat
                    entry[name[6:]] = flat[seg.start:seg.end].clone()
            for name, value in scalars.items():
                if name.startswith("optim.") and value is not None:
                    # float32 on the CPU is how torch.optim creates a non-capturable step
                    entry[name[6:]] = torch.tensor(float(value), dtype=torch.float32)
            if entry:
                state[sd["param_groups"][index]["params"][0]] = entry
        sd["state"] = state
        lrs = scalars.get("group_lr", {})
        for seg, g in zip(self.segments, sd["param_groups"]):
            if seg.key in lrs:
                g["lr"] = lrs[seg.key]
        self.inner.load_state_dict(sd)
        if self.scheduler is not None and "scheduler" in scalars:
            sd = self.scheduler.state_dict()
            sd.update(scalars["scheduler"])
            sd["_last_lr"] = [g["lr"] for g in self.inner.param_groups]
            self.scheduler.load_state_dict(sd)
