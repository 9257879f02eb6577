"""Which path an optimizer takes, chosen once when the engine is built: flat pieces of the shard,
or whole parameters with their real shapes.

[Note: optimizer paths]
The flat path ([Note: flat optimizer] in engine/optim.py) hands the optimizer flat 1-D pieces of
the rank's shard: exact, and the cheapest, for an optimizer that is element-wise (each element's
update reads only that element's value, gradient and state, and per-parameter scalars such as a
step count), and silently wrong for any other (Adafactor factors nothing on 1-D pieces, Muon
refuses them, a per-tensor norm is taken over a piece). So it is taken only where zeroray
knows the optimizer is element-wise; everything else takes the whole-parameter path ([Note:
whole-parameter optimizer] in engine/shaped_optim.py), which is exact for any optimizer that
updates each parameter from its own gradient and state. Known element-wise:

- zeroray's own specs (``zr.Adam``, ``zr.AdamW``, ``zr.SGD``) and a callable the user declared
  with ``zr.elementwise(fn)``, by what they are;
- a callable whose optimizer is exactly (``type(...) is``, not ``isinstance``: a subclass may
  override ``step``) one of ``ELEMENTWISE``: torch's Adam, AdamW, SGD, Adagrad, Adadelta,
  Adamax, NAdam, RAdam, RMSprop, Rprop and ASGD. Each is element-wise under every option it
  has (amsgrad, maximize, nesterov, momentum, centered, weight decay decoupled or not,
  foreach, fused, capturable, a tensor learning rate): the scalars they keep (NAdam's
  ``mu_product``, RAdam's rectification, ASGD's ``eta`` and ``mu``) depend on the step count
  only, and the rest is per element.

To know what a callable builds, the engine calls it once more before the real build, over
probe parameters of the real shapes that hold no memory (with the real param groups, names
and overrides), first on the meta device, then, if that build raises (a fused kernel wants a
real device), on the engine's own device as zero tensors expanded to the shape; an optimizer
that makes its state when built (Adagrad's ``sum``) allocates it there, for the moment of the
probe. Then, on the flat path, the optimizer it builds over the flat pieces must be element-wise
too, or the build is refused (the spec builds different things for different
parameters, so zeroray cannot tell). L-BFGS is refused: it re-evaluates the
model through a closure, which zeroray's step has none of.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from zeroray.comm.group import Group
from zeroray.config import ZeroConfig, known_elementwise
from zeroray.engine.optim import DiskOffload, ShardedOptimizer, build_inner, build_segments, local_spans
from zeroray.engine.optim_record import group_key
from zeroray.engine.shaped_optim import WholeParamOptimizer
from zeroray.layout.arena import FlatLayout

ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adadelta,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop,
               torch.optim.ASGD)


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is exactly one of torch's element-wise classes; see [Note: optimizer paths]."""
    return type(optimizer) in ELEMENTWISE


def probe_groups(layout: FlatLayout, overrides: Mapping[str, Dict[str, Any]], device: Any) -> List[dict]:
    """Every trainable parameter as a probe of its real shape holding no memory, named, in the
    param groups the whole-parameter path builds (one per override set, in order)."""
    meta = torch.device(device).type == "meta"
    groups: Dict[str, dict] = {}
    for name in layout.param_names:
        shape = layout.slots[name].shape
        probe = torch.empty(shape, device="meta") if meta else torch.zeros((), device=device).expand(shape)
        key = group_key(overrides[name])
        groups.setdefault(key, {"params": [], **overrides[name]})["params"].append((name, torch.nn.Parameter(probe)))
    return list(groups.values())


def built_class(builder: Callable[[List[dict]], Any], layout: FlatLayout, overrides: Mapping[str, Dict[str, Any]],
                device: Any) -> type:
    """The class of what ``builder`` builds over the probe parameters (meta first, then ``device``)."""
    try:
        return type(build_inner(builder, probe_groups(layout, overrides, "meta")))
    except Exception:  # noqa: BLE001 - a build that needs a real device; the real one raises what is wrong
        return type(build_inner(builder, probe_groups(layout, overrides, device)))


def build_optimizer(spec: Any, storage: Any, layout: FlatLayout, overrides: Mapping[str, Dict[str, Any]],
                    group: Group, zero: ZeroConfig, scheduler: Optional[Callable[[Any], Any]] = None,
                    offload: Optional[DiskOffload] = None) -> Any:
    """The engine's optimizer over ``storage``'s master and gradient: a ``ShardedOptimizer`` (flat)
    or a ``WholeParamOptimizer``, as [Note: optimizer paths] decides. ``overrides``: what
    ``param_groups`` gave every trainable parameter (engine/optim.py's ``param_overrides``)."""
    builder = spec.build if hasattr(spec, "build") else spec
    known = known_elementwise(spec)
    if not known:
        cls = built_class(builder, layout, overrides, storage.grad.device)
        if cls is torch.optim.LBFGS:
            raise ValueError("torch.optim.LBFGS re-evaluates the model through a closure, which zeroray's step has "
                             "none of: use another optimizer")
    if known or cls in ELEMENTWISE:
        segments = build_segments(local_spans(storage.param_spans(), overrides), storage.master.numel(),
                                  breaks=storage.master.breaks())
        flat = ShardedOptimizer(spec, storage.master, storage.grad, segments, zero.max_grad_norm, scheduler,
                                param_spans=storage.param_spans(), offload=offload)
        if not known and not is_elementwise(flat.inner):
            flat.close()
            raise ValueError(
                f"the optimizer spec built {cls.__name__} over the model's parameters but "
                f"{type(flat.inner).__name__} over flat pieces of them, so zeroray cannot tell whether it is "
                "element-wise: make it build the same optimizer whatever it is given, or declare it with "
                "zr.elementwise(...) if it is element-wise")
        return flat
    chunk_bytes = zero.offload_chunk_bytes if offload is not None else zero.base_bucket_bytes
    return WholeParamOptimizer(spec, storage, layout, overrides, group, zero.max_grad_norm, chunk_bytes,
                               scheduler_fn=scheduler, offload=offload)
