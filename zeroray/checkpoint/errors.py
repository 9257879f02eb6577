"""The one exception type of the checkpoint package.

``CheckpointError`` subclasses ``ValueError`` so callers that treat bad user input as
``ValueError`` (the runtime, the CLI) handle a damaged or mismatched checkpoint the same way.
Every message names the file or directory involved and says what to do about it.
"""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, damaged, or does not fit the model it is loaded into."""
