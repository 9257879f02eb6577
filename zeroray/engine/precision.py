"""Mixed precision as ``model.to(dtype)`` runs it: which tensors take the compute dtype, and
the modules that compute in fp32 instead.

[Note: mixed precision]
With ``dtype`` bf16/fp16 the trainable parameters compute in that dtype from their units'
flat buffers (the optimizer keeps the fp32 master, engine/optim.py). For the rest of the model the
rule is ``model.to(dtype)``'s, so that a model written for it runs unchanged (a scale or a
sinusoidal position table registered as a buffer multiplies bf16 activations), with the
exceptions PyTorch's and Hugging Face's own recipes make:

- Floating buffers and frozen parameters take the compute dtype.
- *fp32 modules* compute in fp32: normalisation layers with running statistics (any
  ``_NormBase`` with ``track_running_stats``: BatchNorm, SyncBatchNorm, InstanceNorm with
  running stats; FSDP's MixedPrecision leaves ``_BatchNorm`` in fp32 by default), and the
  modules a Hugging Face model keeps in fp32 (below). Their buffers and frozen parameters
  stay fp32; their forward is wrapped (``MixedPrecision.wrap``, [Note: fp32 regions]): floating
  inputs are cast to fp32, the module's and its descendants' floating parameters read as fp32
  for the call
  (``p.float()``, a differentiable cast, so the gradient reaches the parameter in its compute
  dtype and its bucket as any other). A normalisation layer's floating outputs are cast back to
  the dtype of its first floating input (the compute dtype when there is none), as FSDP's hooks
  for ``_BatchNorm`` cast them; a Hugging Face fp32 module's are left as it computed them (fp32),
  as a model loaded by ``from_pretrained(dtype=...)`` runs it, so the model's own code takes them
  from there as it was written to (T5 adds its fp32 ``wo`` output into the residual stream, which
  then stays fp32; a MoE router's fp32 weights scale the experts' outputs).
- Rotary frequency buffers (named ``inv_freq`` or ``original_inv_freq``) stay fp32: rounding
  them to bf16 moves every position's angle.

``ZeroConfig.cast_buffers`` overrides the buffer rule: None (default) as above; True casts
every floating buffer outside the fp32 modules (``inv_freq`` too); False leaves every buffer
in its own dtype. The fp32 modules' buffers stay fp32 under all three.

A simplification, deliberately: the trainable parameters of an fp32 module live in their
unit's compute-dtype buffer like every other (units are single-dtype, layout/arena.py), so the copy
the forward reads is the fp32 master rounded to the compute dtype once per step, then widened,
and their gradient passes through the compute dtype on its way to the fp32 bucket; the master
and the update keep full precision. FSDP and ``from_pretrained`` instead store such modules'
parameters in fp32. What stays exact is what the recipes are for: statistics accumulated across
steps (running mean and variance) and the arithmetic inside the kept module (a normalisation's
mean and variance over the batch) in fp32. Held against PyTorch's recipes
(tests/dist/test_precision_vs_pytorch.py), this is the one difference left, and it is
measurable: see README, "Mixed precision".

Hugging Face, as transformers 5 loads a model in a low dtype (read in 5.24; the test against
its own functions is tests/unit/test_precision.py): ``_keep_in_fp32_modules_strict`` applies
under bf16 and fp16, ``_keep_in_fp32_modules`` only under fp16 (``PreTrainedModel._get_dtype_plan``).
A pattern matches a parameter or buffer by regular-expression search of its qualified name,
``*`` standing for ``.*`` (``core_model_loading.build_glob_alternation``; transformers 4 matched
whole name components, a subset of these matches), and the module owning a matched tensor is
an fp32 module (as transformers' FSDP plan groups them). Patterns are read from every module
of the model, as ``post_init`` gathers the children's into the root.

State leaves in the user's dtypes: ``original_dtypes`` records each state_dict entry's dtype
before anything is cast, so that exported buffers and frozen parameters load with
``strict=True`` into the fp32 model; loading casts them back into the engine's dtype.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch.nn.modules.batchnorm import _NormBase

from zeroray.engine.forwards import own_forward, restorer

ROTARY_BUFFERS = frozenset({"inv_freq", "original_inv_freq"})


def hf_fp32_patterns(model: torch.nn.Module, dtype: torch.dtype) -> List[str]:
    """The Hugging Face keep-in-fp32 patterns that apply under ``dtype``, from every module."""
    attrs = ["_keep_in_fp32_modules_strict"] if dtype == torch.bfloat16 else \
        ["_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"] if dtype == torch.float16 else []
    patterns: List[str] = []
    for module in model.modules():
        for attr in attrs:
            value = getattr(module, attr, None)
            if isinstance(value, (list, tuple, set, frozenset)):
                patterns.extend(p for p in sorted(value) if isinstance(p, str) and p not in patterns)
    return patterns


def hf_fp32_module_names(model: torch.nn.Module, dtype: torch.dtype) -> Set[str]:
    """Qualified names of the modules owning a tensor that a keep-in-fp32 pattern matches."""
    patterns = hf_fp32_patterns(model, dtype)
    if not patterns:
        return set()
    search = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns)).search
    tensors = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    tensors += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    return {name.rpartition(".")[0] for name in tensors if search(name)}


def keeps_running_stats(module: torch.nn.Module) -> bool:
    return isinstance(module, _NormBase) and bool(module.track_running_stats)


def fp32_modules(model: torch.nn.Module, dtype: torch.dtype) -> List[Tuple[str, torch.nn.Module]]:
    """The outermost fp32 modules (see [Note: mixed precision]), in ``named_modules`` order;
    none under fp32. A module inside another is covered by the outer one's wrapper."""
    if dtype == torch.float32:
        return []
    hf = hf_fp32_module_names(model, dtype)
    out: List[Tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if any(name == o or name.startswith(o + ".") or o == "" for o, _ in out):
            continue
        if name in hf or keeps_running_stats(module):
            out.append((name, module))
    return out


class MixedPrecision:
    """Applies [Note: mixed precision] to ``model`` for compute ``dtype``: casts the untrained
    tensors (``cast``) and wraps the fp32 modules' forwards (``wrap``); remembers each
    state_dict entry's own dtype for export."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, cast_buffers: Optional[bool]) -> None:
        self.model, self.dtype, self.cast_buffers = model, dtype, cast_buffers
        self.original_dtypes: Dict[str, torch.dtype] = {
            k: v.dtype for k, v in model.state_dict(keep_vars=True).items()}
        self.fp32 = fp32_modules(model, dtype)

    def _in_fp32_module(self) -> Set[int]:
        return {id(m) for _, root in self.fp32 for m in root.modules()}

    def cast(self) -> None:
        """Frozen floating parameters and floating buffers to the compute dtype, per the rule."""
        if self.dtype == torch.float32:
            return
        kept = self._in_fp32_module()
        cast: Dict[int, torch.Tensor] = {}  # a buffer two modules share stays one tensor
        with torch.no_grad():
            for module in self.model.modules():
                if id(module) in kept:
                    continue
                for p in module.parameters(recurse=False):
                    if not p.requires_grad and p.is_floating_point():
                        p.data = p.data.to(self.dtype)
                for name, b in module._buffers.items():
                    if b is not None and b.is_floating_point() and self._casts_buffer(name):
                        if id(b) not in cast:
                            cast[id(b)] = b.to(self.dtype)
                        module._buffers[name] = cast[id(b)]

    def _casts_buffer(self, name: str) -> bool:
        if self.cast_buffers is None:
            return name not in ROTARY_BUFFERS
        return self.cast_buffers

    def wrap(self) -> Callable[[], None]:
        """Wrap the forward of each fp32 module and of every module inside one (an instance
        attribute, so module hooks, the stage-3 coordinator's among them, run around it; see
        [Note: fp32 regions]); returns what puts the forwards back."""
        originals, region, seen = [], _Region(), set()
        hf = hf_fp32_module_names(self.model, self.dtype)
        for name, root in self.fp32:
            cast_out = name not in hf  # a normalisation layer's outputs go back to the input dtype
            for module in root.modules():
                if id(module) in seen:  # one module object in two fp32 modules: wrapped once
                    continue
                seen.add(id(module))
                originals.append(own_forward(module))
                module.forward = _fp32_forward(module, module.forward, self.dtype, region, cast_out)

        return restorer(originals)

    def exported(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A host copy of ``value`` (state_dict entry ``name``) in the dtype the model gave it."""
        return value.detach().to("cpu", self.original_dtypes.get(name, value.dtype), copy=True)


def load_untrained(model: torch.nn.Module, tensors: Dict[str, torch.Tensor], skip: Iterable[str]) -> List[str]:
    """Copy saved buffers and frozen parameters into ``model``'s own tensors by state_dict name,
    each cast into the tensor's dtype here (the compute dtype, or fp32 in an fp32 module); entries
    in ``skip`` (the trainable parameters) are left alone. Returns the names not in ``tensors``."""
    skip = set(skip)
    state = model.state_dict(keep_vars=True)
    missing = []
    with torch.no_grad():
        for name, own in state.items():
            if name in skip:
                continue
            if name not in tensors:
                missing.append(name)
                continue
            own.copy_(tensors[name].to(device=own.device, dtype=own.dtype))
    return missing


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` on every tensor in nested tuples (named too), lists and dicts (a Hugging Face
    ModelOutput included: it is updated in place, keeping its class and attributes)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        items = [_map_tensors(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        if type(value) is dict:
            return {k: _map_tensors(v, fn) for k, v in value.items()}
        out = value.copy() if not hasattr(value, "to_tuple") else value
        for k in list(value.keys()):
            out[k] = _map_tensors(value[k], fn)
        return out
    return value


def _first_float_dtype(value: Any) -> Optional[torch.dtype]:
    found: List[torch.dtype] = []

    def see(t: torch.Tensor) -> torch.Tensor:
        if not found and t.is_floating_point():
            found.append(t.dtype)
        return t
    _map_tensors(value, see)
    return found[0] if found else None


class _Region:
    """How deep the running forward is inside fp32 modules' wrappers (0: outside all of them)."""

    def __init__(self) -> None:
        self.depth = 0


def _fp32_forward(module: torch.nn.Module, original: Callable, compute: torch.dtype, region: _Region,
                  cast_out: bool) -> Callable:
    """``original`` run in fp32; see [Note: mixed precision]. ``cast_out``: floating outputs back
    to the first floating input's dtype (a normalisation layer), else left as computed (a Hugging
    Face fp32 module).

    [Note: fp32 regions]
    The outermost fp32 module's wrapper does the work for its whole subtree: inputs to fp32,
    every floating parameter of the subtree read as fp32 (so an ancestor reading a child's
    weight directly, as ``nn.MultiheadAttention`` does, reads fp32 too), outputs back (for a
    normalisation layer). The
    modules inside it are wrapped as well, and their wrapper does nothing while an outer one
    runs (``region.depth``). It acts when one of them runs on its own: when code outside the
    fp32 module calls it, and when activation checkpointing recomputes it in backward, long
    after the outer call returned; the recomputation then computes in fp32 exactly as the
    forward did (the checkpoint checks the recomputed tensors' dtypes against the saved ones)."""
    to_fp32 = lambda t: t.float() if t.is_floating_point() else t  # noqa: E731

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if region.depth:
            return original(*args, **kwargs)
        out_dtype = _first_float_dtype((args, kwargs)) or compute
        args, kwargs = _map_tensors(args, to_fp32), _map_tensors(kwargs, to_fp32)
        swapped: List[Tuple[Dict[str, Any], str, Any]] = []
        widened: Dict[int, torch.Tensor] = {}  # a parameter shared by two owners: one fp32 copy
        region.depth += 1
        try:
            for owner in module.modules():
                for name, p in owner._parameters.items():
                    if p is None or not p.is_floating_point() or p.dtype == torch.float32:
                        continue
                    if id(p) not in widened:
                        widened[id(p)] = p.float()  # a read: stage 3 gathers p if needed (fetch/access.py)
                    swapped.append((owner._parameters, name, p))
                    owner._parameters[name] = widened[id(p)]
            out = original(*args, **kwargs)
        finally:
            region.depth -= 1
            for params, name, p in reversed(swapped):
                params[name] = p
        if not cast_out:
            return out
        return _map_tensors(out, lambda t: t.to(out_dtype) if t.is_floating_point() else t)
    return forward
