"""The wrap policy's unit roots (layout/wrap.py, [Note: wrap policy]): under "auto" an
nn.Sequential inside a block is gathered with its block; a ModuleList inside one still cuts."""
import torch.nn as nn

from tests.models import routed_model
from tests.real_models import mha_gpt
from zeroray.layout.wrap import layout_specs, unit_roots


def test_auto_gathers_an_mha_block_whole_its_sequential_mlp_included():
    # The block's mlp is an nn.Sequential: its Linears were units of their own, hooked apart
    # from their block, so the block's units came in several gathers (mha's 5 per step, gpt's 3).
    model = mha_gpt()
    assert unit_roots(model, "auto") == ["", "blocks.0", "blocks.1"]
    _, _, uses = layout_specs(model, "auto")
    assert sorted(uses) == ["", "blocks.0", "blocks.1"]  # one hooked module per block, and the root
    assert uses["blocks.0"] == ["blocks.0.ln1.weight", "blocks.0.ln1.bias", "blocks.0.attn.in_proj_weight",
                                "blocks.0.attn.in_proj_bias", "blocks.0.attn.out_proj.weight",
                                "blocks.0.attn.out_proj.bias", "blocks.0.ln2.weight", "blocks.0.ln2.bias",
                                "blocks.0.mlp.0.weight", "blocks.0.mlp.0.bias", "blocks.0.mlp.2.weight",
                                "blocks.0.mlp.2.bias"]


def test_module_policy_still_cuts_every_owner():
    roots = unit_roots(mha_gpt(), "module")
    assert {"blocks.0.mlp.0", "blocks.0.mlp.2", "blocks.0.attn", "blocks.0.attn.out_proj"} <= set(roots)


def test_a_list_inside_a_list_is_still_cut_to_its_elements():
    # A ModuleList/Sequential element is a list, not a block: the blocks inside it are cut.
    model = nn.Sequential(nn.Embedding(8, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 8))
    assert unit_roots(model, "auto") == ["", "0", "1", "1.0", "1.1", "2"]
    # Experts, each an nn.Sequential in a ModuleList: each expert's Linear is still hooked on its own.
    assert unit_roots(routed_model(), "auto") == ["", *(f"experts.{e}{part}" for e in range(3)
                                                        for part in ("", ".0", ".1"))]


def test_inside_a_block_a_sequential_does_not_cut_a_module_list_does():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.ff = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))

    class Model(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self):
            super().__init__()
            self.layer = Layer()
            self.blocks = nn.ModuleList([Layer()])
            self.head = nn.Linear(4, 2)

    # Each expert (a router may run only some) is a unit root, gathered whole; the Sequentials are not cut.
    assert unit_roots(Model(), "auto") == ["", "layer", "layer.experts.0", "layer.experts.1", "blocks.0",
                                           "blocks.0.experts.0", "blocks.0.experts.1"]
