"""Issue 41's restore case: a run saved with AdamW(lr=1e-2, weight_decay=0.0) and restored with
``zr.Trainer.restore(ck, model_fn, loss_fn)``, no optimizer restated, against the same run never
interrupted: the largest parameter difference after the next update, per stage.

    python benchmarks/restore_case.py --stages 0 1 2 3

Before restore rebuilt the checkpoint's optimizer, the restored run trained on with the default
AdamW() (lr 1e-3, weight decay 0.01); now the difference is 0 (the same steps, bitwise). Each
stage also prints *before*: the same restore with ``optimizer=zr.AdamW()`` given, which is what
restore used when none was given then (and the log now names the hyperparameters it changes).
The tests that hold it: tests/ray/test_restore_optimizer.py.
"""
from __future__ import annotations

import argparse
import tempfile

import zeroray as zr
from tests.models import lm_loss, make_batches, parity_model


def restore_case(stage: int, workers: int = 2, steps: int = 4) -> dict:
    """The largest parameter difference from the uninterrupted run after the restored run's next
    update, for two restores of one checkpoint: ``"after"`` restores without an optimizer (the
    checkpoint's is rebuilt), ``"before"`` restates ``zr.AdamW()``."""
    batches = make_batches(steps)
    optimizer = zr.AdamW(lr=1e-2, weight_decay=0.0)
    options = dict(zero=zr.ZeroConfig(stage=stage), scaling=zr.ScalingConfig(num_workers=workers))
    with zr.Trainer(parity_model, lm_loss, optimizer=optimizer, **options) as trainer:
        for batch in batches:
            trainer.step(batch)
        uninterrupted = trainer.state_dict()
    diffs = {}
    with tempfile.TemporaryDirectory() as root:
        with zr.Trainer(parity_model, lm_loss, optimizer=optimizer, **options) as trainer:
            for batch in batches[:-1]:
                trainer.step(batch)
            trainer.save(root)
        for case, extra in (("after", {}), ("before", {"optimizer": zr.AdamW()})):
            with zr.Trainer.restore(root, parity_model, lm_loss, **options, **extra) as restored:
                restored.step(batches[-1])
                got = restored.state_dict()
            diffs[case] = max((got[k] - v).abs().max().item() for k, v in uninterrupted.items())
    return diffs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    for stage in args.stages:
        diffs = restore_case(stage, args.workers)
        before, after = diffs["before"], diffs["after"]
        print(f"stage {stage}, {args.workers} workers: max |param - uninterrupted| after the next update: "
              f"before {before:.2e} (restore with the default AdamW()), after {after:.2e} (restore rebuilds "
              "the checkpoint's optimizer)", flush=True)


if __name__ == "__main__":
    main()
