"""Sharded construction (stage 3): each rank keeps exactly its slice of the values that
``torch.manual_seed(seed); model_fn()`` produces, for every rank of 1, 2 and 3 workers.

No processes: build_sharded is called once per (world size, rank) in this process.
"""
import functools

import pytest
import torch
import torch.nn as nn

from examples import gpt
from tests.models import ParityNet
from zeroray.sharded_init import ShardedInitError, build_sharded

SEED = 7
SMALL_GPT = gpt.GPTConfig(d_model=48, n_layers=2, n_heads=4, seq_len=16)
MODELS = {"parity": ParityNet, "gpt": functools.partial(gpt.GPT, SMALL_GPT)}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny tensors: on a shared, loaded machine a second intra-op thread only adds spin-waits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference(model_fn):
    torch.manual_seed(SEED)
    model = model_fn()
    return model, torch.get_rng_state()


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("world", [1, 2, 3])
def test_kept_slices_equal_the_plain_construction(model, world):
    model_fn = MODELS[model]
    ref, ref_rng = reference(model_fn)
    ref_params = dict(ref.named_parameters())
    covered = {}
    for rank in range(world):
        built = build_sharded(model_fn, SEED, world, rank)
        assert built is not None
        sharded, layout, kept = built
        # Random numbers were drawn exactly as in the plain construction.
        assert torch.equal(torch.get_rng_state(), ref_rng)
        assert set(kept) == set(layout.param_names)
        for name in layout.param_names:
            lo, hi, values = kept[name]
            slot = layout.slots[name]
            u_lo, u_hi = layout.units[slot.unit].rank_range(rank)
            want_lo = min(max(u_lo - slot.offset, 0), slot.numel)
            want_hi = max(min(u_hi - slot.offset, slot.numel), 0)
            # This rank's piece of the parameter, (0, 0) when it owns none of it.
            assert (lo, hi) == ((want_lo, want_hi) if want_hi > want_lo else (0, 0)), (name, rank)
            assert values.numel() == hi - lo, (name, rank)
            assert torch.equal(values, ref_params[name].detach().reshape(-1)[lo:hi]), (name, rank)
            covered.setdefault(name, []).append((lo, hi))
            # The rest of the parameter is gone: no full copy survives construction.
            assert dict(sharded.named_parameters())[name].numel() == 0
        # Frozen parameters and buffers are replicated, whole, with the plain values.
        trained = set(layout.slots)
        for key, value in ref.state_dict().items():
            if key not in trained:
                assert torch.equal(sharded.state_dict()[key], value), (key, rank)
    # The ranks' slices tile every parameter exactly once.
    for name, ranges in covered.items():
        pieces = sorted(r for r in ranges if r[1] > r[0])
        assert pieces[0][0] == 0 and pieces[-1][1] == ref_params[name].numel(), name
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), (name, pieces)


def test_tied_and_frozen_structure_survive():
    sharded, layout, _ = build_sharded(ParityNet, SEED, 2, 1)
    assert sharded.head.weight is sharded.emb.weight  # tied: one parameter
    assert "head.weight" not in layout.param_names and "emb.weight" in layout.param_names
    assert not sharded.frozen.weight.requires_grad
    assert sharded.frozen.weight.numel() == sharded.frozen.weight.shape[0] * sharded.frozen.weight.shape[1]


class _ParentInit(nn.Module):
    """GPT-2/nanoGPT style: the parent re-initialises its children at the end of __init__."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)
        if how == "apply":
            self.apply(self._init)
        elif how == "zeros":  # a write that does not fail on overlapping memory by itself
            with torch.no_grad():
                self.b.bias.zero_()
        elif how == "rebind":
            self.a.weight.data = torch.randn(8, 8)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)


@pytest.mark.parametrize("how", ["apply", "zeros", "rebind"])
def test_parent_writing_a_childs_parameters_is_a_clear_error(how):
    with pytest.raises(ShardedInitError, match=r"sharded_init=False"):
        build_sharded(lambda: _ParentInit(how), SEED, 2, 0)
    # Constructors are restored afterwards, whatever happened.
    assert nn.Linear(2, 2).weight.numel() == 4


class _NeedsData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.width = int(torch.tensor([3.0]).item())  # reads real data: impossible on meta


def test_a_model_that_cannot_be_built_on_meta_falls_back():
    assert build_sharded(_NeedsData, SEED, 2, 0) is None
    assert nn.Linear(2, 2).weight.numel() == 4
