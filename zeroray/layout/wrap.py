"""The wrap policy: which modules gather their subtree's parameters together, as FSDP's units.

[Note: wrap policy]
The flat layout (layout/arena.py) always cuts the parameters into fine *units*, one per module that
directly owns trainable parameters: that is the grain of sharding, of gradient buckets and
of checkpoints, whatever the policy. The wrap policy chooses *unit roots*: modules whose
forward gathers every fine unit of their subtree (except what a deeper unit root gathers
itself), with coalesced collectives, and keeps them gathered until it returns. So code in
that forward may read any parameter of the subtree without calling the module that owns it
(``nn.MultiheadAttention`` reads ``out_proj.weight`` directly; a GPT's root reads
``wte.weight`` for its output head), and one block costs one or a few collectives rather
than one per layer. The model's root is always a unit root (it takes whatever no other
unit root takes).

Policies (``ZeroConfig(wrap=...)``):
- ``"auto"`` (default): every element of an ``nn.ModuleList``/``nn.Sequential`` (the model's
  repeated blocks) and every module whose class is named in the model's
  ``_no_split_modules`` (Hugging Face's own list of its blocks), plus the root. Inside a
  block chosen so (one that is not itself a ModuleList/Sequential), an ``nn.Sequential`` does
  not cut: a block's ``mlp = nn.Sequential(Linear, GELU, Linear)`` is gathered with its block.
  A Sequential runs every element inside its block's forward, so cutting it only freed its
  units a little before the block's end, and it made the block's units several gathers issued
  at later positions of the trace (the benchmark's mha: 5 all-gathers per step where gpt, the
  same sizes, has 3; each one a point where the ranks meet). The block then holds as many
  gathered bytes as a block written without a Sequential. An ``nn.ModuleList`` inside a block still cuts: its elements may run only on some
  steps (experts a router picks), and a unit of their own gathers only those that run. A
  ModuleList/Sequential that is itself an element (``nn.Sequential(*blocks)`` held in a list) is a
  list, not a block: its elements are still cut.
- ``"module"``: every module that directly owns a trainable parameter (the finest grain: the
  fewest bytes gathered at once, the most collectives).
- a tuple of ``nn.Module`` classes: modules of those classes, plus the root;
- a callable ``(qualified_name, module) -> bool``, plus the root.

A module elsewhere whose forward uses a parameter of a unit outside its unit root's subtree
directly (a tied head whose weight lives in the embedding's unit) gathers that unit too.
A parameter read anywhere else (in ``loss_fn``, or functionally outside its subtree) is
caught when read and gathered on demand; see [Note: parameter access] in fetch/access.py.

Pure: reads names, structure and shapes off a module (the meta-device model works).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple, Union

import torch

WrapPolicy = Union[str, Tuple[type, ...], Callable[[str, torch.nn.Module], bool]]
POLICY_NAMES = ("auto", "module")

UnitSpecs = List[Tuple[str, List[Tuple[str, Tuple[int, ...]]]]]


def check_policy(policy: object) -> None:
    """Raise ValueError for a wrap policy that is none of the accepted forms."""
    if isinstance(policy, str):
        if policy not in POLICY_NAMES:
            raise ValueError(f"ZeroConfig.wrap={policy!r} is invalid: use 'auto', 'module', a tuple of nn.Module "
                             "classes, or a callable (qualified_name, module) -> bool")
        return
    if isinstance(policy, tuple):
        if not policy or not all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in policy):
            raise ValueError(f"ZeroConfig.wrap={policy!r} is invalid: a tuple must hold nn.Module classes")
        return
    if not callable(policy):
        raise ValueError(f"ZeroConfig.wrap={policy!r} is invalid: use 'auto', 'module', a tuple of nn.Module "
                         "classes, or a callable (qualified_name, module) -> bool")


def _owns_trainable(module: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


def _roots_unit(policy: WrapPolicy, model: torch.nn.Module, name: str, module: torch.nn.Module,
                parent: torch.nn.Module, no_split: Sequence[str]) -> bool:
    if policy == "module":
        return _owns_trainable(module)
    if policy == "auto":
        return (isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential))
                or type(module).__name__ in no_split)
    if isinstance(policy, tuple):
        return isinstance(module, policy)
    return bool(policy(name, module))


def _under(name: str, ancestors: set) -> bool:
    """Module ``name`` lies strictly below one of ``ancestors``."""
    while "." in name:
        name = name.rsplit(".", 1)[0]
        if name in ancestors:
            return True
    return False


def unit_roots(model: torch.nn.Module, policy: WrapPolicy) -> List[str]:
    """Qualified names of the modules that root a unit, in ``named_modules()`` order ("" first)."""
    check_policy(policy)
    no_split = tuple(getattr(model, "_no_split_modules", None) or ())
    modules = dict(model.named_modules())
    roots = [""]
    blocks: set = set()  # "auto": the blocks it chose; a Sequential inside one does not cut ([Note: wrap policy])
    for name, module in model.named_modules():
        if not name:
            continue
        parent = modules[name.rsplit(".", 1)[0]] if "." in name else model
        if policy == "auto" and isinstance(parent, torch.nn.Sequential) and type(module).__name__ not in no_split \
                and _under(name, blocks):
            continue
        if _roots_unit(policy, model, name, module, parent, no_split):
            roots.append(name)
            if policy == "auto" and not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
                blocks.add(name)
    return roots


def _enclosing(name: str, roots: set) -> str:
    """The nearest unit root at or above module ``name``."""
    while name and name not in roots:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name


def layout_specs(model: torch.nn.Module, policy: WrapPolicy = "module"
                 ) -> Tuple[UnitSpecs, Dict[str, List[str]], Dict[str, List[str]]]:
    """(unit_specs, aliases, module_uses) for ``FlatLayout``; see [Note: wrap policy].

    unit_specs: one fine unit per module that directly owns trainable parameters, in
        ``named_modules()`` order, with its (parameter name, shape) list;
    aliases: canonical parameter name -> the other names of a tied parameter;
    module_uses: hooked module -> the parameters (canonical names) whose units its forward
        gathers: for a unit root, those of its subtree not under a deeper unit root."""
    roots = set(unit_roots(model, policy))
    owner: Dict[int, str] = {}            # id(param) -> canonical name
    owner_module: Dict[str, str] = {}     # canonical name -> the module that owns it
    aliases: Dict[str, List[str]] = {}
    unit_specs: UnitSpecs = []
    direct: Dict[str, List[str]] = {}     # module -> canonical names of the params it holds directly
    for mname, module in model.named_modules(remove_duplicate=False):
        own = []
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            full = f"{mname}.{pname}" if mname else pname
            if id(p) in owner:
                canonical = owner[id(p)]
                if full != canonical and full not in aliases.setdefault(canonical, []):
                    aliases[canonical].append(full)
            else:
                canonical = owner[id(p)] = full
                owner_module[canonical] = mname
                own.append((full, tuple(p.shape)))
            direct.setdefault(mname, []).append(canonical)
        if own:
            unit_specs.append((mname, own))
    module_uses: Dict[str, List[str]] = {}
    for canonical, mname in owner_module.items():  # layout order
        module_uses.setdefault(_enclosing(mname, roots), []).append(canonical)
    for mname, names in direct.items():
        enclosing = _enclosing(mname, roots)
        foreign = [n for n in names if _enclosing(owner_module[n], roots) != enclosing]
        uses = module_uses.setdefault(mname, [])
        uses.extend(n for n in foreign if n not in uses)
    return unit_specs, {k: v for k, v in aliases.items() if v}, {m: u for m, u in module_uses.items() if u}
