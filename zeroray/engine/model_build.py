"""Building one rank's model: whole from ``model_fn`` after the seed, or sharded (stage 3 with
``sharded_init``), its flat layout, and the saved weights a ``model_fn`` may carry.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

from zeroray.config import ZeroConfig
from zeroray.construct.sharded_init import build_sharded
from zeroray.engine.initial_values import Kept
from zeroray.layout.arena import FlatLayout
from zeroray.layout.stage import StagePolicy


def build_model(model_fn: Callable[[], torch.nn.Module], seed: int, zero: ZeroConfig, policy: StagePolicy,
                world: int, rank: int, device: torch.device) -> Tuple[torch.nn.Module, FlatLayout, Kept]:
    """(model on ``device``, its layout, the slices a sharded build kept or None)."""
    wrap = zero.wrap
    built = None
    if policy.reshard_after_use and zero.sharded_init:
        built = build_sharded(model_fn, seed, world, rank,
                              layout_fn=lambda m: FlatLayout.from_module(m, world, wrap))
    if built is not None:
        model, layout, kept = built
    else:
        torch.manual_seed(seed)
        model, layout, kept = model_fn(), None, None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model_fn returned {type(model).__name__}, not a torch.nn.Module")
    model = model.to(device)
    if layout is None:
        layout = FlatLayout.from_module(model, world, wrap)
    if not layout.units:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False): "
                         "there is nothing to train")
    return model, layout, kept


def load_saved_weights(model_fn, model: torch.nn.Module, layout: FlatLayout,
                       named: Dict[str, torch.nn.Parameter], kept: Kept) -> None:
    """A ``model_fn`` that carries saved weights (``zeroray.hf.pretrained``): overwrite the
    initial values with them, each rank reading only what it holds ([Note: the sliced loading
    contract] in zeroray/hf): its slice of each trainable parameter when built sharded (into
    the kept slices, in place), the whole parameter otherwise; replicated tensors whole."""
    aliases = {n: list(layout.slots[n].aliases) for n in layout.param_names}
    if kept is not None:
        model_fn.read_pieces({n: kept[n][:2] for n in layout.param_names}, aliases,
                             out={n: kept[n][2] for n in layout.param_names})
    else:
        with torch.no_grad():
            model_fn.read_pieces({n: (0, named[n].numel()) for n in layout.param_names}, aliases,
                                 out={n: named[n].detach().view(-1) for n in layout.param_names})
    state = model.state_dict(keep_vars=True)
    replicated = [k for k in state if k not in layout.slots]
    with torch.no_grad():
        for name, value in model_fn.read_whole(replicated).items():
            state[name].copy_(value.to(state[name].dtype))
