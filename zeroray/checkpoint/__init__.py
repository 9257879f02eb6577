"""Sharded checkpoints: save per rank, commit atomically, load at any world size, consolidate.

Layout on disk and the write protocol: [Note: checkpoint commit protocol] in store.py.
Range math of N -> M resharding: [Note: resharding] in reshard.py. No Ray in here: the
runtime calls these from worker actors (``write_shard``, ``load_resharded``) and from the
driver (``commit``, ``latest_checkpoint``, ``load_manifest``).
"""
from zeroray.checkpoint.commands import cli_consolidate, cli_inspect
from zeroray.checkpoint.consolidate import (consolidate, full_state_dict, iter_full_params,
                                            parameter_count)
from zeroray.checkpoint.errors import CheckpointError
from zeroray.checkpoint.filesystem import StoragePath
from zeroray.checkpoint.manifest import FileEntry, Manifest, ManifestFields, ShardInfo
from zeroray.checkpoint.reshard import (Copy, apply_plan, check_same_params, load_resharded, plan,
                                        reshard_in_memory)
from zeroray.checkpoint.reader import CheckpointReader, load_extra, read_shard_slices
from zeroray.checkpoint.store import (checkpoint_dir, commit, is_sharded_key, latest_checkpoint,
                                      list_checkpoints, load_manifest, write_extra, write_shard)
from zeroray.checkpoint.verify import SkippedCheckpoint, restore_candidates, verify_files

__all__ = [
    "CheckpointError", "CheckpointReader", "Copy", "FileEntry", "Manifest", "ManifestFields", "ShardInfo",
    "SkippedCheckpoint", "StoragePath", "apply_plan", "check_same_params", "checkpoint_dir",
    "cli_consolidate", "cli_inspect", "commit", "consolidate",
    "full_state_dict", "is_sharded_key", "iter_full_params", "latest_checkpoint",
    "list_checkpoints", "load_extra", "load_manifest", "load_resharded", "parameter_count", "plan",
    "read_shard_slices", "reshard_in_memory", "restore_candidates", "verify_files", "write_extra",
    "write_shard",
]
