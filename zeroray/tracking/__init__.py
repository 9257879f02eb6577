"""Experiment tracking: ``zr.Callback``s that log fit's and evaluate's figures to TensorBoard,
MLflow or Weights & Biases, from the driver only.

    from zeroray.tracking import TensorBoardCallback
    with TensorBoardCallback("runs/exp1") as tb:
        trainer.fit(batches, eval_data=held_out, eval_every=50, callbacks=[tb])

Each tracker needs its own package, an extra of zeroray's (``pip install 'zeroray[tensorboard]'``,
``[mlflow]``, ``[wandb]``), imported only when the tracker is built. What is logged, and under
which names: tracking/scalars.py.
"""
from zeroray.tracking.mlflow import MLflowCallback
from zeroray.tracking.scalars import Tracker
from zeroray.tracking.tensorboard import TensorBoardCallback
from zeroray.tracking.wandb import WandbCallback

__all__ = ["Tracker", "TensorBoardCallback", "MLflowCallback", "WandbCallback"]
