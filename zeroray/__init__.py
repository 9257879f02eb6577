"""zeroray: ZeRO sharded training (stages 0-3, ZeRO-R) of PyTorch models on Ray."""
from zeroray.config import (Adam, AdamW, CheckpointConfig, Elementwise, FailureConfig, SGD, ScalingConfig,
                            ZeroConfig, elementwise)
from zeroray.context import WorkerContext, worker_context

__all__ = ["Adam", "AdamW", "SGD", "elementwise", "Elementwise", "ZeroConfig", "ScalingConfig", "FailureConfig",
           "CheckpointConfig", "Trainer", "StepResult", "Callback", "estimate_memory", "WorkerContext", "worker_context"]


def __getattr__(name):
    # Lazy: `import zeroray` must not import ray (the engine layers run without it).
    if name in ("Trainer", "StepResult"):
        from zeroray.runtime import trainer

        return getattr(trainer, name)
    if name == "Callback":
        from zeroray.runtime.fit.callbacks import Callback

        return Callback
    if name == "estimate_memory":
        from zeroray.memory.model import estimate_memory

        return estimate_memory
    raise AttributeError(f"module 'zeroray' has no attribute {name!r}")
