"""``pretrained(path)``: a ``model_fn`` for a saved Hugging Face model whose workers each read
only their own slices of its safetensors files.

Calling it builds the architecture from the saved config with random init (fp32); the
weights come afterwards, through ``read_pieces`` (the elements of each parameter that a rank
owns) and ``read_whole`` (the replicated tensors: frozen parameters, persistent buffers). The
contract with whoever builds the model is in the package docstring (zeroray/hf/__init__.py).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from zeroray.checkpoint.errors import CheckpointError
from zeroray.hf.architecture import ModelInfo, build_model, describe, load_config
from zeroray.hf.files import SavedWeights

log = logging.getLogger("zeroray")

_SHOWN = 5  # names listed in one error message


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class PretrainedModel:
    """A picklable ``() -> nn.Module`` for the model saved in directory ``path``.

    Pickling keeps only ``path``, ``model_class`` and ``config_overrides``; what it learns
    about the architecture (a meta-device build, once per process) is recomputed where it
    is unpickled, and files are opened only inside ``read_pieces``/``read_whole``.
    """

    def __init__(self, path: str, model_class: Optional[type] = None,
                 config_overrides: Optional[Mapping[str, Any]] = None) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.model_class = model_class
        self.config_overrides = dict(config_overrides or {})
        self._info: Optional[ModelInfo] = None

    def __getstate__(self) -> dict:
        return {"path": self.path, "model_class": self.model_class,
                "config_overrides": self.config_overrides}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["model_class"], state["config_overrides"])

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.config_overrides.items())
        cls = f", model_class={self.model_class.__name__}" if self.model_class else ""
        return f"pretrained({self.path!r}{cls}{extra})"

    def config(self):
        return load_config(self.path, **self.config_overrides)

    def __call__(self) -> torch.nn.Module:
        return build_model(self.config(), self.model_class, torch.float32)

    def info(self) -> ModelInfo:
        """Names, shapes and tied groups of the model this builds (a meta build, cached)."""
        if self._info is None:
            try:
                self._info = describe(self)
            except Exception as e:  # noqa: BLE001 - a model class that cannot be built on meta
                # The checks it enables are a safety net, not a need: read by exact names instead.
                log.warning("%r: cannot build the model on the meta device (%s: %s); reading without "
                            "checking shapes or finding tied names and base-model prefixes",
                            self, type(e).__name__, e)
                self._info = ModelInfo(getattr(self.model_class, "__name__", "the model"), {}, {}, "")
        return self._info

    # --- reading ---------------------------------------------------------------------------

    def _sources(self, weights: SavedWeights, names: Iterable[str],
                 aliases: Optional[Mapping[str, Sequence[str]]]) -> Tuple[Dict[str, str], List[str]]:
        """name -> the name it has in the files (itself, a given alias, a tied name, each with or
        without the base model prefix; see [Note: names in the files]), and the names not found."""
        info, aliases = self.info(), aliases or {}
        found, missing = {}, []
        for name in names:
            candidates = [name, *aliases.get(name, ()), *info.tied_with(name)]
            source = weights.find([s for c in candidates for s in info.spellings(c)])
            if source is None:
                missing.append(name)
            else:
                found[name] = source
        return found, missing

    def _check_shape(self, weights: SavedWeights, name: str, source: str) -> int:
        """The element count of ``name``, after checking the file's shape against the model's."""
        saved = weights.spec(source).shape
        spec = self.info().specs.get(name)
        if spec is not None and tuple(spec[0]) != tuple(saved):
            raise CheckpointError(
                f"{weights.display}: {source!r} is saved with shape {list(saved)} but {name!r} of the "
                f"model built from its config has shape {list(spec[0])}; config overrides "
                f"{self.config_overrides or '(none)'} must not change the architecture's sizes")
        return _numel(saved)

    def _missing_error(self, weights: SavedWeights, missing: List[str]) -> CheckpointError:
        shown = ", ".join(repr(n) for n in missing[:_SHOWN])
        more = f" and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else ""
        return CheckpointError(
            f"{shown}{more} not found in {weights.display} (searched {', '.join(weights.files)}, also "
            "under tied names, the aliases given and with or without the base model prefix "
            f"{self.info().base_model_prefix!r}). These files do not hold the weights of "
            f"{self.info().class_name} as built from their config: pass the model_class they were "
            "saved from, or load the model whole with model_fn=lambda: "
            "AutoModelForCausalLM.from_pretrained(path)")

    def read_pieces(self, wanted: Mapping[str, Tuple[int, int]],
                    aliases: Optional[Mapping[str, Sequence[str]]] = None, *,
                    out: Optional[Mapping[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
        """For each ``name: (lo, hi)``, the flat row-major elements ``[lo, hi)`` of that
        parameter's saved value, as a 1-D fp32 tensor, reading only those bytes.

        ``aliases``: other names to look ``name`` up under (tied weights the files hold once;
        the model's own ties are found without it). ``out``: optional ``name -> 1-D tensor of
        hi - lo elements`` (e.g. views into the rank's shard) to read into instead of new
        tensors, so no second copy of the shard exists at any time; it is returned.
        A name the files do not hold is a ``CheckpointError`` naming it and the files.
        """
        with SavedWeights(self.path) as weights:
            found, missing = self._sources(weights, wanted, aliases)
            if missing:
                raise self._missing_error(weights, missing)
            result: Dict[str, torch.Tensor] = {}
            for name, (lo, hi) in wanted.items():
                source = found[name]
                numel = self._check_shape(weights, name, source)
                if not 0 <= lo <= hi <= numel:
                    raise ValueError(f"range [{lo}, {hi}) of {name!r} is outside its {numel} elements")
                if out is not None and name in out:
                    target = out[name]
                    if target.dim() != 1 or target.numel() != hi - lo:
                        raise ValueError(f"out[{name!r}] has shape {list(target.shape)}; it must be 1-D with "
                                         f"the {hi - lo} elements of the range [{lo}, {hi})")
                else:
                    target = torch.empty(hi - lo, dtype=torch.float32)
                result[name] = weights.file_of(source).read_flat_into(source, lo, target)
        return result

    def read_whole(self, names: Iterable[str],
                   aliases: Optional[Mapping[str, Sequence[str]]] = None) -> Dict[str, torch.Tensor]:
        """The saved values of those of ``names`` the files hold, whole, in their own shape
        (floating ones as fp32). Names they lack are left out of the result and logged once, as
        from_pretrained warns: the model keeps the values it was built with."""
        with SavedWeights(self.path) as weights:
            found, missing = self._sources(weights, list(names), aliases)
            if missing:
                log.warning("%s holds no %s; these keep the values the model was built with",
                            weights.display, ", ".join(missing))
            result = {}
            for name, source in found.items():
                self._check_shape(weights, name, source)
                t = weights.file_of(source).read(source)
                result[name] = t.float() if t.is_floating_point() else t
        return result


def pretrained(path: str, model_class: Optional[type] = None, **config_overrides: Any) -> PretrainedModel:
    """A ``model_fn`` for the Hugging Face model saved in directory ``path`` (what
    ``save_pretrained`` wrote, or a ``huggingface_hub.snapshot_download`` of it), whose workers
    read only their own slices of its weights. ``model_class`` defaults to
    ``AutoModelForCausalLM``; ``config_overrides`` are passed to ``AutoConfig.from_pretrained``
    (e.g. dropout rates; not sizes)."""
    if not os.path.isdir(os.fspath(path)):
        raise ValueError(f"{path} is not a directory: give the directory save_pretrained wrote (with "
                         "config.json and model.safetensors), e.g. one from huggingface_hub.snapshot_download")
    return PretrainedModel(path, model_class, config_overrides)
