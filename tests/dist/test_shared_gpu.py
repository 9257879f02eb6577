"""Several ranks on one device through host-staged gloo (tests/staged_group.py): every stage
matches single-process PyTorch. On CPU this checks the staging; with a CUDA device, two ranks
share GPU 0 and the multi-rank engine runs on CUDA tensors (not NCCL: see the note there)."""
import pytest
import torch

import zeroray as zr
from tests.dist.harness import run_engines
from tests.dist.test_engine_parity import ADAMW, assert_parity, ref_adamw
from tests.models import lm_loss, make_batches, parity_model, reference_run

STEPS = 4


def check_every_stage(device: str) -> None:
    batches = make_batches(STEPS)
    ref = reference_run(parity_model, lm_loss, ref_adamw, batches)
    specs = [dict(model_fn=parity_model, loss_fn=lm_loss, optimizer=zr.AdamW(**ADAMW),
                  zero=zr.ZeroConfig(stage=stage), batches=batches, host_staged=True, device=device)
             for stage in range(4)]
    for (results, params) in run_engines(2, specs):
        assert_parity(ref, results, params)


def test_host_staged_ranks_match_pytorch_on_cpu():
    check_every_stage("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_ranks_share_one_gpu():
    check_every_stage("cuda:0")
