"""GPU checks: run only where a CUDA device is present (skipped otherwise, by the `gpu` marker)."""
import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stage_parity_on_cuda():
    from tests.device_parity import parity

    assert parity("cuda:0")


def test_engine_runs_device_agnostic_code_on_cpu():
    """The CUDA path is the CPU path with another device: the same engine call on 'cpu' works."""
    import zeroray as zr
    from tests.models import lm_loss, make_batches, parity_model
    from zeroray.comm.group import SoloGroup
    from zeroray.engine.engine import Engine

    engine = Engine(parity_model, lm_loss, zr.AdamW(lr=1e-2), zr.ZeroConfig(stage=3), SoloGroup(),
                    device=torch.device("cpu"))
    assert engine.train_step(make_batches(1)[0]).loss > 0
