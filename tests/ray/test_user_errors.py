"""User errors never poison the group ([Note: step outcome] in zeroray/errors.py), at stage 3 on
2 workers: an exception in ``loss_fn`` or in a module's forward (after that module's parameters
were gathered, so its post-hook never runs), on one worker or on both. After each failed step:

- the error is the user's own, from the worker that raised it;
- nothing stays gathered: the measured parameter bytes (``memory_report``) and every worker's
  live tensor bytes (a census of the worker process) are back at their level after a good step;
- the next step works, follows the recorded prefetch trace as before (``comm_report``: same
  fetches, prefetch hits and peak gathered bytes as a step before any error), and the weights
  equal those of a run that never saw the failed batches.
"""
import pytest
import ray
import torch
import torch.nn as nn

import zeroray as zr
from tests.models import VOCAB, ParityNet, lm_loss, make_batches, reference_run
from zeroray.memory.report import live_tensor_bytes

MARK = VOCAB - 3  # a worker whose whole share is this token raises
OPT = dict(lr=1e-2, weight_decay=0.1)


class Fragile(nn.Linear):
    """A linear layer whose forward raises after computing (its parameters are gathered by then)."""

    def forward(self, x, explode=False):
        y = super().forward(x)
        if explode:
            raise ArithmeticError("bad value in forward")
        return y


class FragileNet(ParityNet):
    def __init__(self):
        super().__init__()
        self.fragile = Fragile(7, 7)

    def forward(self, idx):
        x = self.fragile(self.emb(idx), explode=bool((idx == MARK).all()))
        return self.head(self.norm(self.frozen(torch.tanh(self.shared(x)))))


def fragile_model():
    return FragileNet()


def raising_loss(model, batch):
    idx, tgt = batch
    if bool((idx == MARK - 1).all()):
        raise KeyError("labels")
    return lm_loss(model, batch)


def _marked(batch, token, ranks):
    idx, tgt = batch
    idx = idx.clone()
    half = idx.shape[0] // 2
    for r in ranks:
        idx[r * half:(r + 1) * half] = token
    return idx, tgt


def _worker_state(trainer):
    """Per worker: measured parameter bytes, and live tensor bytes of the whole process."""
    mem = [(r["measured"]["params"], r["measured"]["grads"], r["measured"]["optimizer"])
           for r in trainer.memory_report()]
    census = ray.get([a.__ray_call__.remote(lambda self: live_tensor_bytes(floating_only=False))
                      for a in trainer.controller.group.actors])
    return mem, census


def _fetching(trainer):
    return [{k: r[k] for k in ("fetches", "prefetch_hits", "on_demand", "peak_gathered_bytes", "rounds")}
            for r in trainer.comm_report()]


def test_errors_in_loss_fn_and_forward_leave_the_group_as_it_was(ray_local):
    batches = make_batches(6)
    cases = [("loss_fn, worker 1", MARK - 1, [1], KeyError), ("loss_fn, both", MARK - 1, [0, 1], KeyError),
             ("forward, worker 1", MARK, [1], ArithmeticError), ("forward, both", MARK, [0, 1], ArithmeticError)]
    with zr.Trainer(fragile_model, raising_loss, optimizer=zr.AdamW(**OPT), zero=zr.ZeroConfig(stage=3, wrap="module"),
                    scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        trainer.step(batches[0])
        trainer.step(batches[1])  # a step on the recorded trace
        steady, steady_fetch = _worker_state(trainer), _fetching(trainer)
        pids = [w["pid"] for w in trainer.workers]
        good = iter(batches[2:])
        for name, token, ranks, kind in cases:
            with pytest.raises(kind) as info:
                trainer.step(_marked(batches[0], token, ranks))
            notes = "\n".join(info.value.__notes__)
            assert f"raised on worker {ranks[0]} (pid" in notes, (name, notes)
            after_error = _worker_state(trainer)
            result = trainer.step(next(good))
            after_step, fetch = _worker_state(trainer), _fetching(trainer)
            print(f"\n  {name}: params bytes {after_error[0]}, live tensor bytes {after_error[1]} "
                  f"(steady {steady[1]}); next step {result.step}, fetch {fetch[0]}")
            assert after_error[0] == steady[0] and after_step[0] == steady[0], name  # nothing left gathered
            assert after_error[1] == steady[1] and after_step[1] == steady[1], name  # nothing else held either
            assert fetch == steady_fetch, (name, fetch, steady_fetch)  # the trace still holds, same prefetch
        assert [w["pid"] for w in trainer.workers] == pids and trainer.step_count == 6
        state = trainer.state_dict()
    make_opt = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], **OPT)  # noqa: E731
    want = reference_run(fragile_model, lm_loss, make_opt, batches)[2]
    assert max((state[k] - v).abs().max().item() for k, v in want.items()) <= 1e-5
