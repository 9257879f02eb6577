"""Stages 1-2 see parameter reads only while a publish is in flight ([Note: reads during a
publish] in fetch/publish.py): the access class is on from the publish until every unit's gather was
waited for, and a read made before forward (an L2 penalty first in loss_fn) still waits for
the update it reads, on 2 workers, in parity with single-process PyTorch."""
import torch

import zeroray as zr
from tests.dist.harness import run_engine
from tests.dist.test_engine_parity import assert_parity
from tests.dist.test_real_models import ADAMW, ref_adamw
from tests.models import reference_run
from tests.real_models import FACTORIES, real_batches, real_loss
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine


def penalty_first_loss(model, batch):
    """An L2 penalty read before the model runs: the deferred publish may still be in flight."""
    penalty = 1e-3 * sum((p.float() ** 2).sum() for p in model.parameters())
    return penalty + real_loss(model, batch)


def test_access_is_on_only_while_a_publish_is_in_flight():
    seen = []

    def loss_fn(model, batch):
        seen.append({type(p) for p in model.parameters()})  # before forward: this step's reads
        return real_loss(model, batch)

    engine = Engine(FACTORIES["mha"], loss_fn, zr.AdamW(**ADAMW), zr.ZeroConfig(stage=2), SoloGroup())
    plain, seeing = {torch.nn.Parameter}, {engine.coordinator.access.cls}
    assert {type(p) for p in engine.model.parameters()} == plain  # nothing gathering yet
    batches = real_batches(2, batch=4)
    engine.train_step(batches[0])
    assert {type(p) for p in engine.model.parameters()} == seeing  # the step ended with a publish
    engine.train_step(batches[1])
    assert seen == [plain, seeing]
    engine.flush()
    assert {type(p) for p in engine.model.parameters()} == plain
    engine.close()


def test_a_read_before_forward_waits_for_the_publish():
    batches = real_batches(3)
    ref = reference_run(FACTORIES["mha"], penalty_first_loss, ref_adamw, batches)
    for stage in (1, 2):
        results, params = run_engine(2, model_fn=FACTORIES["mha"], loss_fn=penalty_first_loss,
                                     optimizer=zr.AdamW(**ADAMW), zero=zr.ZeroConfig(stage=stage), batches=batches)
        assert_parity(ref, results, params)
