"""Planning on paper: a step simulator driven by the engine's own schedule code, and the
``zeroray plan`` / ``stage="auto"`` choices built on it. See docs/planning.md.

Pure: no ray, no torch.distributed; torch is imported only to read a module on the meta
device (workload.from_module). Importing this package imports neither torch nor ray.
"""
from zeroray.plan.hardware import GPU_PRESETS, Cluster, cluster_preset
from zeroray.plan.planner import choose_stage, largest_models, plan
from zeroray.plan.replay import RunConfig, StepReport, simulate
from zeroray.plan.workload import MODEL_PRESETS, Workload, from_hf_config, from_module, from_params, model_preset

__all__ = ["Cluster", "GPU_PRESETS", "cluster_preset", "Workload", "MODEL_PRESETS", "model_preset", "from_hf_config",
           "from_module", "from_params", "RunConfig", "StepReport", "simulate", "plan", "largest_models",
           "choose_stage"]
