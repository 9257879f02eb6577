"""The safetensors files of a saved Hugging Face model, read by element range.

A model directory holds either one ``model.safetensors`` or several shard files listed in
``model.safetensors.index.json`` (``{"weight_map": {name: file}}``). ``SavedWeights`` maps
each tensor name to its file and reads any element range with one ranged read of exactly
those bytes (the checkpoint package's ``TensorFileReader``): a worker that needs a quarter of
a tensor reads a quarter of its bytes, and never holds a whole file.
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional

from zeroray.checkpoint.errors import CheckpointError
from zeroray.checkpoint.filesystem import PathLike, resolve
from zeroray.checkpoint.tensorfile import TensorFileReader, TensorSpec

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class SavedWeights:
    """Open with ``with SavedWeights(path) as w:``; each file is opened on first use."""

    def __init__(self, path: PathLike) -> None:
        self.storage, self.dir = resolve(path)
        self.display = self.storage.display(self.dir)
        self._readers: Dict[str, TensorFileReader] = {}
        index = self.storage.join(self.dir, INDEX_NAME)
        if self.storage.entry(index) is not None:
            self.weight_map = self._read_index(index)
        elif self.storage.entry(self.storage.join(self.dir, SINGLE_NAME)) is not None:
            self.weight_map = {name: SINGLE_NAME for name in self.reader(SINGLE_NAME).entries}
        else:
            raise CheckpointError(
                f"{self.display} has neither {SINGLE_NAME} nor {INDEX_NAME}: reading by slice needs the "
                "safetensors files that save_pretrained writes (safe_serialization, its default). Resave "
                "the model with save_pretrained, or load it whole in model_fn with from_pretrained")
        self.files: List[str] = sorted(set(self.weight_map.values()))

    def _read_index(self, index: str) -> Dict[str, str]:
        try:
            weight_map = json.loads(self.storage.read_bytes(index))["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{self.storage.display(index)} is not a safetensors index (no JSON "
                                  f"'weight_map': {e!r}); the file is damaged, resave the model") from e
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise CheckpointError(f"{self.storage.display(index)}: 'weight_map' must map tensor names to "
                                  "file names; the file is damaged, resave the model")
        return weight_map

    def reader(self, file: str) -> TensorFileReader:
        if file not in self._readers:
            path = self.storage.join(self.dir, file)
            if self.storage.entry(path) is None:
                raise CheckpointError(f"{self.storage.display(path)} is missing but {INDEX_NAME} lists "
                                      "it; copy the whole model directory again")
            self._readers[file] = TensorFileReader(self.storage.open_range(path))
        return self._readers[file]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def find(self, candidates: List[str]) -> Optional[str]:
        """The first of ``candidates`` that the files hold."""
        return next((c for c in candidates if c in self.weight_map), None)

    def spec(self, name: str) -> TensorSpec:
        return self.reader(self.weight_map[name]).spec(name)

    def file_of(self, name: str) -> TensorFileReader:
        return self.reader(self.weight_map[name])

    def close(self) -> None:
        for r in self._readers.values():
            r.file.close()
        self._readers.clear()

    def __enter__(self) -> "SavedWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
