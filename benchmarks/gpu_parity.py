"""The correctness parts of benchmarks/gpu_check.py: each compares a run with a reference.

- ``engine``: stages 0-3 against plain PyTorch (fp32, the tests' awkward model), through the
  SoloGroup and through a real world-1 process group (tests/device_parity.py, which
  tests/unit/test_gpu.py runs too); and restore at the engine level (export -> import into a
  new engine -> continue) against an uninterrupted engine.
- ``shared``: two ranks on one device through host-staged gloo (tests/staged_group.py).
- ``trainer``: the Ray Trainer on the device, save -> Trainer.restore -> continue against an
  uninterrupted Trainer.

Each part returns ``{"failures": [...], ...}``; an empty list means it passed.
"""
from __future__ import annotations

import functools
import os
import tempfile
from typing import List

from benchmarks.gpu_setup import Setup
import gpt  # examples/gpt.py, on sys.path through gpu_setup

import zeroray as zr
from tests.device_parity import ADAMW, TOL, parity, parity_engine


def engine_restore(setup: Setup, failures: List[str]) -> None:
    """Item 1 of the issue at the engine level: a restored engine steps and continues exactly."""
    from tests.models import make_batches

    batches = make_batches(6)
    for stage in range(4):
        whole = parity_engine(setup.device, stage)
        for b in batches:
            whole.train_step(b)
        want = whole.master_shard()
        whole.close()
        first = parity_engine(setup.device, stage)
        for b in batches[:3]:
            first.train_step(b)
        state = first.export_state()
        first.close()
        second = parity_engine(setup.device, stage)
        try:
            second.import_state(*state)
            for b in batches[3:]:
                second.train_step(b)
            err = (second.master_shard() - want).abs().max().item()
            devices = sorted({f"{k} {v.device.type}" for s in second.optimizer.inner.state.values()
                              for k, v in s.items()})
            line = (f"restore stage {stage}: max abs param diff vs uninterrupted {err:.2e}; "
                    f"state on {', '.join(devices)}")
            good = err <= TOL
        except Exception as error:  # noqa: BLE001 - reported, and the other stages still run
            line, good = f"restore stage {stage}: {type(error).__name__}: {error}", False
        finally:
            second.close()
        print(f"{line} {'OK' if good else 'FAIL'}", flush=True)
        if not good:
            failures.append(line)


def engine_part(setup: Setup) -> dict:
    failures: List[str] = []
    parity(setup.device, setup.backend, failures)
    engine_restore(setup, failures)
    return {"failures": failures}


def shared_part(setup: Setup) -> dict:
    """Two ranks on one device through host-staged gloo; NCCL is not involved (see its note)."""
    from tests.dist.test_shared_gpu import check_every_stage

    try:
        check_every_stage(setup.device)
    except Exception as error:  # noqa: BLE001
        print(f"shared device, 2 ranks, host-staged gloo: FAIL\n{error}", flush=True)
        return {"failures": [f"shared device: {type(error).__name__}: {str(error)[:500]}"]}
    print(f"shared device ({setup.device}), 2 ranks, host-staged gloo, stages 0-3: parity OK", flush=True)
    return {"failures": []}


def trainer_part(setup: Setup, steps: int = 6, split: int = 3) -> dict:
    """zr.Trainer with one worker on the device: save -> restore -> continue == uninterrupted."""
    import ray

    # The workers import zeroray and examples/gpt.py through the environment they inherit.
    paths = [os.path.dirname(gpt.__file__), os.path.dirname(os.path.dirname(zr.__file__))]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    ray.init(num_cpus=4, num_gpus=1 if setup.cuda else 0, include_dashboard=False, log_to_driver=False)
    cfg = setup.trainer_model
    batches = list(gpt.CharBatches(setup.trainer_batch, cfg.seq_len, steps, seed=1))
    kwargs = dict(optimizer=zr.AdamW(**ADAMW), zero=zr.ZeroConfig(stage=3),
                  scaling=zr.ScalingConfig(num_workers=1, use_gpu=setup.cuda), seed=0)
    model_fn = functools.partial(gpt.GPT, cfg)
    failures: List[str] = []
    try:
        with zr.Trainer(model_fn, gpt.gpt_loss, **kwargs) as whole:
            losses = [whole.step(b).loss for b in batches]
            want = whole.state_dict()
        with tempfile.TemporaryDirectory() as root:
            with zr.Trainer(model_fn, gpt.gpt_loss, **kwargs) as first:
                for b in batches[:split]:
                    first.step(b)
                first.save(root)
            with zr.Trainer.restore(root, model_fn, gpt.gpt_loss, **kwargs) as restored:
                got_losses = [restored.step(b).loss for b in batches[split:]]
                got = restored.state_dict()
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(got_losses, losses[split:]))
        param_err = max((got[k] - v).abs().max().item() for k, v in want.items())
        good = loss_err <= TOL and param_err <= TOL
        line = (f"trainer (1 worker, {'GPU' if setup.cuda else 'CPU'}, stage 3, fp32): save at step {split} -> "
                f"restore -> {steps - split} steps vs uninterrupted: max rel loss diff {loss_err:.2e}, "
                f"max abs param diff {param_err:.2e}")
        print(f"{line} {'OK' if good else 'FAIL'}", flush=True)
        if not good:
            failures.append(line)
    except Exception as error:  # noqa: BLE001
        print(f"trainer: FAIL {type(error).__name__}: {error}", flush=True)
        failures.append(f"trainer: {type(error).__name__}: {str(error)[:500]}")
    finally:
        ray.shutdown()
    return {"failures": failures}
