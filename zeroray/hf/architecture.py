"""A Hugging Face model's architecture without its weights: its config, the model built from
it, and what a meta-device build tells (names, shapes, dtypes, tied weights).

transformers is imported inside the functions, so importing zeroray.hf costs nothing and
needs nothing for users who never call them.

[Note: names in the files]
``save_pretrained`` writes each tensor under its ``model.state_dict()`` name, except that of
each group of tied weights (one ``Parameter`` under several names, such as GPT-2's
``lm_head.weight`` and ``transformer.wte.weight``) it writes one name only: the *source*, the
name that is not a key of the model's ``all_tied_weights_keys`` ({target: source}).
``from_pretrained`` then ties the target to it again. Checkpoints saved from the base model
(older hub files of GPT-2 have ``h.0.attn...`` where ``GPT2LMHeadModel`` says
``transformer.h.0.attn...``) differ by the class's ``base_model_prefix``. ``ModelInfo``
records both, so the reader can find a name where the files put it and the writer can put
it where ``from_pretrained`` looks.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

CONFIG_NAME = "config.json"

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def import_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("zeroray.hf needs the transformers package: pip install transformers") from e
    return transformers


def as_dtype(dtype: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    """None, a floating torch.dtype, or one of fp32/bf16/fp16 (or their long names)."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype={dtype!r} is invalid: give torch.float32, torch.bfloat16 or torch.float16 "
                     "(or 'fp32', 'bf16', 'fp16'), or None to keep fp32")


def load_config(config: Any, **overrides: Any):
    """A fresh ``PretrainedConfig`` from a config object (copied, never modified), a dict with a
    ``"model_type"``, or the path of a saved model directory or of its config.json."""
    tf = import_transformers()
    if isinstance(config, tf.PretrainedConfig):
        cfg = copy.deepcopy(config)
        cfg.update(overrides)
        return cfg
    if isinstance(config, Mapping):
        fields = dict(config)
        model_type = fields.pop("model_type", None)
        if not model_type:
            raise ValueError("the config dict has no 'model_type' (e.g. 'gpt2', 'llama'); pass the "
                             "model's config object, its config.json path, or a dict that names its type")
        return tf.AutoConfig.for_model(model_type, **{**fields, **overrides})
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        where = os.path.join(path, CONFIG_NAME) if os.path.isdir(path) else path
        if not os.path.isfile(where):
            raise ValueError(f"{where} does not exist: give the directory that save_pretrained wrote "
                             "(it holds config.json) or the path of a config.json")
        return tf.AutoConfig.from_pretrained(where, **overrides)
    raise ValueError(f"config must be a transformers PretrainedConfig, a dict or a path, "
                     f"not {type(config).__name__}")


def build_model(config, model_class: Optional[type] = None,
                dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``model_class`` (default ``AutoModelForCausalLM``) built from ``config`` with random
    init, its floating tensors in ``dtype``. transformers 5 builds in ``config.dtype`` (the dtype
    the model was saved in), so the dtype is passed explicitly."""
    tf = import_transformers()
    cls = model_class or tf.AutoModelForCausalLM
    if hasattr(cls, "from_config"):  # the Auto* classes
        model = cls.from_config(config, dtype=dtype)
    else:
        model = cls(config)
    if any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
        model = model.to(dtype)
    return model


@dataclass(frozen=True)
class ModelInfo:
    """What the files of a model hold, learned from a build on the meta device."""

    class_name: str
    specs: Dict[str, Tuple[Tuple[int, ...], torch.dtype]]  # state_dict name -> (shape, dtype)
    kept: Dict[str, str]  # every name of a tied group -> the one name the files hold
    base_model_prefix: str

    @property
    def file_names(self) -> List[str]:
        """The names ``save_pretrained`` writes, in state_dict order. See [Note: names in the files]."""
        return [n for n in self.specs if self.kept.get(n, n) == n]

    def tied_with(self, name: str) -> List[str]:
        """The other names of ``name``'s tied group (empty when it is not tied)."""
        kept = self.kept.get(name)
        return [] if kept is None else [n for n, k in self.kept.items() if k == kept and n != name]

    def spellings(self, name: str) -> List[str]:
        """``name`` and its spelling with or without the base model prefix."""
        p = self.base_model_prefix
        if not p:
            return [name]
        return [name, name[len(p) + 1:] if name.startswith(p + ".") else f"{p}.{name}"]


def describe(build: Callable[[], torch.nn.Module]) -> ModelInfo:
    """Build on the meta device (no memory, no random numbers drawn) and read the structure."""
    with torch.device("meta"):
        model = build()
    tensors = model.state_dict(keep_vars=True)
    targets = set(getattr(model, "all_tied_weights_keys", None) or ())
    groups: Dict[int, List[str]] = {}
    for name, t in tensors.items():
        groups.setdefault(id(t), []).append(name)
    kept: Dict[str, str] = {}
    for names in groups.values():
        if len(names) > 1:
            sources = [n for n in names if n not in targets]
            for n in names:
                kept[n] = (sources or names)[0]
    specs = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
    return ModelInfo(type(model).__name__, specs, kept, getattr(model, "base_model_prefix", "") or "")
