"""The fp32 master in the disk tier's files, for mixed precision with offload="disk".

[Note: master on disk]
In mixed precision (bf16, fp16) the fp32 master is a copy of the parameters of its own ([Note:
stage data flow] in engine/storage.py), 4 bytes per element of the rank's shard (of the whole
model at stage 0) that only the optimizer step reads and writes. With ``offload="disk"`` it
lives in the tier's files beside the optimizer state, as one more file (``master``), and a
step reads it chunk by chunk with the state ([Note: disk offload] in offload/stepper.py): read a
chunk of master and state into a slot, step it there, cast the updated chunk straight into the
parameter memory compute reads (``target``: the arena at stage 0, the arena's rows at stages 1-2,
the stage-3 parameter shard the units are gathered from), and write master and state back. The
cast is the one the storage's publish makes of the whole master (``copy_``, element by
element), so the parameters are bitwise those of the run with the master in memory, and the
publish then only starts the stage 1-2 gathers. In fp32 the master *is* the parameters (the
arena, its rows), which compute or the gathers read, so it stays in memory; at stage 3 the
parameter shard is in a file of its own ([Note: parameter shard on disk] in offload/shard.py),
the target in every dtype, whose ``write`` casts a chunk and writes it behind the step (in
fp32 that file is the master's own: ``DiskStepper.shared``).

``DiskMaster`` stands where the master's ``LocalShard`` stands in the storage, offering what
its users ask of it: ``numel`` and ``breaks`` (none, as for a master in memory: the
optimizer's segments are cut where they are without offload, so every element takes the
same vector path of the kernel, and a chunk spanning pieces of the target is cast into each),
``read`` (a range, from the
file), ``cpu`` (all of it: checkpoints), ``copy_`` (an import: into the file and, cast, into
the target) and ``tensors`` (for the memory report: none once the values are in the file).
Its slices (``master[a:b]``) are what the flat optimizer's pieces are made of: they give each
piece its shape and identity in the inner optimizer, while the values are stepped in the
slots. They view one shared zero element (an expanded tensor), so they hold no memory, and a
write into one fails loudly ("more than one element of the written-to tensor refers to a
single memory location") instead of being lost. The initial values are held in memory until
the disk stepper exists (``attach``), which writes them into the file.
"""
from __future__ import annotations

from typing import List, Optional, Union

import torch

from zeroray.layout.local_shard import LocalShard
from zeroray.offload.shard import DiskShard


class DiskMaster:
    """The fp32 master whose values live in the disk stepper's ``master`` file, cast into
    ``target`` (the parameter memory, in the same coordinates) as they are updated; see
    [Note: master on disk]. ``initial``: its first values, held until ``attach``."""

    dtype = torch.float32

    def __init__(self, initial: torch.Tensor, target: Union[LocalShard, DiskShard]) -> None:
        if initial.numel() != target.numel():
            raise ValueError(f"the master ({initial.numel()} elements) and the parameter memory it is cast into "
                             f"({target.numel()}) must be in the same coordinates")
        self.target = target
        self.device = initial.device
        self._numel = initial.numel()
        self._initial: Optional[torch.Tensor] = initial.detach().to(torch.float32)
        self._placeholder = torch.zeros(1, dtype=torch.float32, device=self.device).expand(max(self._numel, 1))
        self.stepper = None  # the DiskStepper whose files hold the values, once attached

    def attach(self, stepper) -> None:
        """Move the initial values into ``stepper``'s master file; from now on it holds them."""
        if self._initial is None:
            raise RuntimeError("the master is on disk already")
        self.stepper = stepper
        if not stepper.shared:  # shared (fp32, stage 3): the shard's file holds these very values already
            stepper.write_master(0, self._initial)
        self._initial = None

    # --- what the storage and the optimizer ask of a master ---------------------------------

    def numel(self) -> int:
        return self._numel

    def breaks(self) -> List[int]:
        """None: the master is one run of its file, as a master in memory is one tensor. (The
        optimizer's segments, and so its chunks, are then cut where they are in memory, which
        keeps every element on the same vector path; a chunk that spans pieces of the target is
        cast into each: ``LocalShard.write``.)"""
        return []

    def tensors(self) -> List[torch.Tensor]:
        """The master's tensors in memory (the memory report): the initial values until attached."""
        return [] if self._initial is None else [self._initial]

    def __getitem__(self, index: slice) -> torch.Tensor:
        """A placeholder of elements [a, b)'s shape that holds no values (a flat piece's identity)."""
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a DiskMaster is indexed by a slice [a:b] only")
        a, b, _ = index.indices(self._numel)
        return self._placeholder[a:max(a, b)]

    def read(self, a: int, b: int) -> torch.Tensor:
        """Elements [a, b), a new tensor in host memory."""
        if self._initial is not None:
            return self._initial[a:b].clone()
        return self.stepper.read_master(a, b)

    def cpu(self) -> torch.Tensor:
        """The whole master, a new tensor in host memory."""
        return self.read(0, self._numel)

    def write(self, a: int, src: torch.Tensor) -> None:
        """Write the 1D ``src`` over elements [a, a + src.numel()): into the file, and cast into the
        target (the whole-parameter optimizer's update, one parameter's slice at a time)."""
        values = src.detach().to(torch.float32).reshape(-1)
        if self._initial is not None:
            self._initial[a:a + values.numel()].copy_(values)
        else:
            self.stepper.write_master(a, values.cpu())  # shared: the target's file is the master's
            if self.stepper.shared:
                return
        done = self.target.write(a, values.to(self.target.device))
        if done is not None:  # the parameter shard on disk: its write
            done.result()

    def copy_(self, src: Union[LocalShard, torch.Tensor]) -> "DiskMaster":
        """Load a whole master (an import): into the file, and cast into the target."""
        values = src.cpu() if isinstance(src, LocalShard) else src.detach()
        values = values.to(torch.float32).contiguous()
        if values.numel() != self._numel:
            raise ValueError(f"a master of {values.numel()} elements does not fit this one of {self._numel}")
        if self._initial is not None:
            self._initial.copy_(values)
        else:
            self.stepper.write_master(0, values.cpu())
        self.target.copy_(values.to(self.target.device))
        return self
