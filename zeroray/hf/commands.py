"""What ``zeroray export-hf CKPT OUT --config PATH`` does (cli.py parses the arguments and
calls this). Returns the process exit code: 0 success, 1 a checkpoint problem, 2 a missing
dependency; a config that does not fit the checkpoint is a ValueError, which the CLI reports
as a usage error (2). Messages go to stderr, one line, saying what to do."""
from __future__ import annotations

import sys
from typing import Optional, TextIO

from zeroray.checkpoint.errors import CheckpointError
from zeroray.checkpoint.filesystem import PathLike
from zeroray.checkpoint.store import load_manifest
from zeroray.hf.export import export_checkpoint


def cli_export_hf(path: PathLike, out_dir: PathLike, config: str, max_shard_bytes: int,
                  dtype: str = "fp32", out: Optional[TextIO] = None) -> int:
    out = out or sys.stdout
    try:
        m = load_manifest(path)
        written = export_checkpoint(m, out_dir, config=config, max_shard_bytes=max_shard_bytes, dtype=dtype)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    weights = [w for w in written if w.endswith(".safetensors")]
    print(f"wrote {len(written)} files to {out_dir} (step {m.step}, {len(weights)} safetensors file(s), "
          f"{dtype}); load with transformers.AutoModelForCausalLM.from_pretrained({str(out_dir)!r})", file=out)
    return 0
