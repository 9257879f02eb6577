"""The flat optimizer's pieces: the flat parameters the inner torch optimizer steps, and how
they split so that a parameter no rank used in a step is skipped as torch skips it.

[Note: unused parameters]
Torch (one process, and DDP with ``find_unused_parameters=True``) leaves the ``.grad`` of a
parameter that no backward of the step reached at None, and every torch optimizer skips such
a parameter: no update, no weight decay, no step count, its state neither created nor
changed. A parameter that some rank used gets the average over the ranks, the others
counting zero (the reducer does that). Which parameters no rank used comes from the step
status all-reduce ([Note: step status] in engine/step_status.py): a rank counts a parameter as used
when its post-accumulate-grad hook fired in some micro-batch of the step (a gradient that
exists but is all zero is used, as in torch).

The inner optimizer steps flat pieces ([Note: flat optimizer] in engine/optim.py), each with one
state (one ``step``). A model whose parameters are all used in every step keeps the merged
segments it was built with. A step that leaves parameters unused first splits the pieces
that hold them (this rank's part of them) at the start of each unused parameter and at the
start of the parameter after it, so that padding stays with the parameter before it; each
new piece takes its slice of the old piece's state and a copy of its 0-dim state (``step``).
The new pieces replace the old one inside the same torch param group: the groups, which an
LR scheduler holds, do not change. Then the pieces made only of unused parameters get
``.grad = None`` for that step, and the inner optimizer, whichever it is (a user's callable
too), skips them; their gradient views are put back afterwards. Pieces stay split: from then
on their step counts can differ.

The slices are views of the old state tensors, not copies: splitting a large segment does
not hold its state twice, and the old storages live exactly as long as their pieces do (the
memory report counts storages, not tensors).
"""
from __future__ import annotations

import bisect
import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Sequence, Tuple, Union

import torch

from zeroray.layout.local_shard import LocalShard


@dataclass
class FlatPiece:
    start: int
    end: int
    param: torch.nn.Parameter


class FlatPieces:
    """The pieces of this rank's flat fp32 master that the inner optimizer steps, in order;
    see [Note: unused parameters]. ``bounds``: the [start, end) of each base segment;
    ``param_spans``: the local [start, end) of every parameter this rank holds, in order."""

    def __init__(self, master: Union[torch.Tensor, LocalShard], grad: torch.Tensor,
                 bounds: Sequence[Tuple[int, int]], param_spans: Mapping[str, Tuple[int, int]]) -> None:
        self.master, self.grad = master, grad
        self.bounds = list(bounds)
        self.pieces = [self._piece(a, b) for a, b in self.bounds]
        spans = sorted(param_spans.items(), key=lambda item: item[1][0])
        self.names = [name for name, _ in spans]
        self.spans = [span for _, span in spans]
        self.starts = [start for start, _ in self.spans]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.inner: Any = None  # the torch optimizer, once built over the first pieces

    def _piece(self, start: int, end: int) -> FlatPiece:
        p = torch.nn.Parameter(self.master[start:end])
        p.grad = self.grad[start:end]
        return FlatPiece(start, end, p)

    @property
    def params(self) -> List[torch.nn.Parameter]:
        return [pc.param for pc in self.pieces]

    def span_of(self, name: str) -> Tuple[int, int]:
        return self.spans[self.index[name]]

    def params_in(self, piece: FlatPiece) -> List[str]:
        """The parameters whose local span starts in ``piece``."""
        return self.names[bisect.bisect_left(self.starts, piece.start):bisect.bisect_left(self.starts, piece.end)]

    # --- splitting ------------------------------------------------------------------------

    def cuts_around(self, names: Iterable[str]) -> List[int]:
        """Where to split so that each of ``names`` (those held here) is a piece of its own."""
        cuts = set()
        for name in names:
            i = self.index.get(name)
            if i is not None:
                cuts.add(self.starts[i])
                if i + 1 < len(self.starts):
                    cuts.add(self.starts[i + 1])
        return sorted(cuts)

    def split(self, cuts: Sequence[int]) -> None:
        """Split every piece that a cut falls strictly inside, carrying its state."""
        out: List[FlatPiece] = []
        cuts = sorted(cuts)
        for pc in self.pieces:
            inside = cuts[bisect.bisect_right(cuts, pc.start):bisect.bisect_left(cuts, pc.end)]
            if not inside:
                out.append(pc)
                continue
            edges = [pc.start, *inside, pc.end]
            new = [self._piece(a, b) for a, b in zip(edges, edges[1:])]
            state = self.inner.state.pop(pc.param, None)
            if state:
                for piece in new:
                    self.inner.state[piece.param] = _slice_state(state, pc, piece)
            self._replace([pc.param], [piece.param for piece in new])
            out += new
        self.pieces = out

    def reset(self) -> None:
        """Back to one piece per base segment, with no state (an import then loads it)."""
        out = []
        for a, b in self.bounds:
            old = [pc for pc in self.pieces if a <= pc.start < b]
            for pc in old:
                self.inner.state.pop(pc.param, None)
            fresh = self._piece(a, b)
            self._replace([pc.param for pc in old], [fresh.param])
            out.append(fresh)
        self.pieces = out

    def _replace(self, old: List[torch.nn.Parameter], new: List[torch.nn.Parameter]) -> None:
        """Put ``new`` where the run ``old`` stands in its torch param group."""
        for group in self.inner.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if p is old[0]:
                    if any(q is not o for q, o in zip(params[i:i + len(old)], old)):
                        raise RuntimeError("the optimizer's param group no longer holds the flat pieces in order")
                    params[i:i + len(old)] = new
                    return
        raise RuntimeError("a flat piece is in none of the optimizer's param groups; a spec must keep the "
                           "params it was given")

    def cuts_between(self, signature: Any) -> List[int]:
        """Where to split so that neighbouring parameters whose ``signature(start, end)``
        differs are in different pieces (an import: [Note: per-element state] in engine/optim.py)."""
        cuts, last = [], None
        for i, (start, end) in enumerate(self.spans):
            sig = signature(start, end)
            if i and sig != last:
                cuts.append(start)
            last = sig
        return cuts

    # --- one step -------------------------------------------------------------------------

    @contextlib.contextmanager
    def skipping(self, unused: Sequence[str]) -> Iterator[None]:
        """Within: the pieces holding only parameters in ``unused`` have no gradient."""
        skipped: List[FlatPiece] = []
        if unused:
            held = [n for n in unused if n in self.index]
            if held:
                self.split(self.cuts_around(held))
                gone = set(held)
                skipped = [pc for pc in self.pieces if (names := self.params_in(pc)) and gone.issuperset(names)]
        for pc in skipped:
            pc.param.grad = None
        try:
            yield
        finally:
            for pc in skipped:
                pc.param.grad = self.grad[pc.start:pc.end]


def _slice_state(state: Dict[str, Any], old: FlatPiece, new: FlatPiece) -> Dict[str, Any]:
    """``new``'s share of ``old``'s state: views of the per-element tensors, copies of the rest."""
    a, b = new.start - old.start, new.end - old.start
    out: Dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape != old.param.shape:
                raise ValueError(f"the optimizer keeps state {key!r} of shape {tuple(value.shape)} for a flat "
                                 f"parameter of shape {tuple(old.param.shape)}: it is not elementwise, so "
                                 "zeroray cannot give a parameter that got no gradient its own state. Use an "
                                 "elementwise optimizer (Adam, AdamW, SGD, ...)")
            out[key] = value[a:b]
        elif isinstance(value, torch.Tensor):
            out[key] = value.clone()
        else:
            out[key] = copy.deepcopy(value)
    return out
