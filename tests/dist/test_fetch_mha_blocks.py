"""Stage 3 on a model built from nn.MultiheadAttention gathers its blocks as a model written
out by hand does ([Note: wrap policy] in layout/wrap.py): the same gathers per step, none more
on demand, and training equal to PyTorch's.

The block's MLP is an ``nn.Sequential``; "auto" cut its Linears into units hooked apart from
their block, so the schedule issued a block's units in several gathers at later positions of
the trace (the benchmark's mha: 5 all-gathers per step where gpt has 3)."""
import torch
import torch.nn as nn

import zeroray as zr
from tests.dist.harness import run_engines
from tests.dist.test_engine_parity import assert_parity
from tests.models import reference_run
from tests.real_models import HEADS, MHAGPT, WIDTH, mha_gpt, real_batches, real_loss

ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-5)  # test_real_models' (eps: attention's key bias)
STEPS = 4


class HandBlock(nn.Module):
    """tests.real_models.MHABlock with its MLP's Linears as attributes (no nn.Sequential):
    the same parameters in the same order, so the same units and bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


def hand_gpt() -> nn.Module:
    """tests.real_models.MHAGPT with HandBlock blocks."""
    return MHAGPT(block=HandBlock)


def test_an_mha_model_gathers_its_blocks_like_a_hand_written_one():
    world = 2
    batches = real_batches(STEPS, batch=4 * world)
    block_bytes = sum(p.numel() for p in HandBlock().parameters()) * 4
    # A window of one and a half blocks: the schedule slides, so the positions where it issues matter.
    zero = zr.ZeroConfig(stage=3, prefetch_bytes=block_bytes * 3 // 2)
    runs = run_engines(world, [dict(model_fn=m, loss_fn=real_loss, optimizer=zr.AdamW(**ADAMW), zero=zero,
                                    batches=batches) for m in (mha_gpt, hand_gpt)])

    def per_step(results):  # after the first (negotiated) step: (all-gathers, units gathered on demand)
        return [(r["collectives"]["all_gather"]["calls"], r["fetch"]["on_demand"])
                for r in results[0]["reports"][1:]]

    (mha_results, mha_params), (hand_results, _) = runs
    assert per_step(mha_results) == per_step(hand_results), (per_step(mha_results), per_step(hand_results))
    ref = reference_run(mha_gpt, real_loss,
                        lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], **ADAMW),
                        batches)
    assert_parity(ref, mha_results, mha_params)
