"""Rank 0's buffers on every rank at the start of each engine call, as torch DDP gives them.

[Note: buffers follow DDP]
A buffer is not trained: each rank's forward updates its own (a BatchNorm's running mean and
variance from its own rows, ``num_batches_tracked``), so without a rule the ranks' buffers
drift apart. torch DDP's default (``broadcast_buffers=True``, which torch 2.13 renames
``forward_sync_buffers``) is that rank 0's win: at a forward that follows a forward which
synchronised gradients (and at the first), DDP broadcasts every buffer of the module
(``named_buffers()``, persistent or not) from rank 0 before it runs.
So, checked against DDP over gloo in tests/dist/test_buffer_broadcast.py:

- every rank starts each step's forward with rank 0's buffers; with gradient accumulation
  (``no_sync`` on all but the last micro-batch) only the first micro-batch's forward
  broadcasts, so within a step each rank's micro-batches update its own buffers on from
  rank 0's;
- an evaluation after a step (eval mode, ``torch.no_grad()``) broadcasts first too, so every
  rank evaluates with rank 0's statistics; a forward without gradients does not set DDP's flag,
  so the forward after it (the next evaluation batch, or the next step) does not broadcast:
  the ranks hold rank 0's buffers from the evaluation's broadcast already, unless the
  evaluation itself changed them.

The engine gives every rank rank 0's buffers at the start of each step (before the first
micro-batch), of each ``evaluate`` call and of each ``run`` call: the same buffers as DDP's at
every forward for a model whose evaluation leaves its buffers alone (BatchNorm, a position
table, a scale), and one rule instead of DDP's flag. It is one broadcast on zeroray's group:
every buffer's bytes packed into one uint8 tensor (each at an offset aligned to its element
size, so its bytes read back as its dtype), none when the model has no buffer or runs alone.
Rank 0's buffers are what ``state_dict()``, checkpoints and snapshots hold, and what every
worker gets after a restore, a resize or a recovery; with the broadcast, a recovered run's
workers hold exactly the buffers of the uninterrupted run at the next step and evaluation, so
recovery stays bitwise, evaluation included (tests/ray/test_snapshot_recovery.py).
``ZeroConfig(broadcast_buffers=False)`` (DDP's ``broadcast_buffers=False``) keeps each
worker's own buffers through training and evaluation; a restore, resize or recovery still
starts every worker from rank 0's, which is all a checkpoint holds.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from zeroray.comm.group import Group


class BufferBroadcast:
    """Gives every rank of ``group`` rank 0's buffers of ``model``; see [Note: buffers follow DDP].
    ``enabled`` False, a model without buffers or a group of one: does nothing."""

    def __init__(self, model: torch.nn.Module, group: Group, enabled: bool) -> None:
        self.model, self.group = model, group
        self.active = enabled and group.world_size > 1 and any(True for _ in model.buffers())

    def __call__(self) -> None:
        if not self.active:
            return
        # Read each call: mixed precision casts buffers into new tensors, and a module may
        # register a buffer again (Hugging Face's dynamic rotary embedding does).
        buffers = [b for _, b in self.model.named_buffers()]
        flat, spans = _pack(buffers)
        self.group.broadcast(flat, src=0)
        if self.group.rank == 0:
            return
        with torch.no_grad():
            for b, (start, nbytes) in zip(buffers, spans):
                b.copy_(flat[start:start + nbytes].view(b.dtype).view(b.shape))


def _pack(buffers: List[torch.Tensor]) -> Tuple[torch.Tensor, List[Tuple[int, int]]]:
    """Every buffer's bytes in one uint8 tensor, and each one's (offset, bytes) in it."""
    spans, offset = [], 0
    for b in buffers:
        size = b.element_size()
        offset = -(-offset // size) * size
        spans.append((offset, b.numel() * size))
        offset += b.numel() * size
    device = buffers[0].device
    flat = torch.zeros(offset, dtype=torch.uint8, device=device)
    with torch.no_grad():
        for b, (start, nbytes) in zip(buffers, spans):
            if nbytes:
                flat[start:start + nbytes].copy_(b.detach().reshape(-1).view(torch.uint8))
    return flat, spans
