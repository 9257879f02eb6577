"""Stages 0-3 of the engine on one device against plain PyTorch, through the SoloGroup and
through a real world-size-1 process group.

tests/unit/test_gpu.py runs it on CUDA; benchmarks/gpu_check.py runs it as the first part of its
``engine`` check (and its timing part builds the same world-1 group).
"""
from __future__ import annotations

import datetime
from typing import Dict, List, Optional

import torch

import zeroray as zr
from tests.models import lm_loss, make_batches, parity_model
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine

TOL = 1e-5
ADAMW = dict(lr=1e-2, weight_decay=0.1)


def world1_group(backend: str, timeout_s: float = 120.0):
    """A real process group of size 1, built as the Ray workers build theirs for several ranks.

    ``make_torch_group`` returns the SoloGroup shortcut at world size 1, where nothing of the
    NCCL path runs; this builds the store and the backend directly and wraps them in the same
    ``TorchGroup`` the workers use.
    """
    import torch.distributed as dist

    from zeroray.comm.group import TorchGroup
    from zeroray.comm.port import free_port

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timeout, wait_for_workers=True)
    store = dist.PrefixStore("gpu_check", store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return TorchGroup(dist.ProcessGroupNCCL(store, 0, 1, opts), 0, 1, "nccl")
    # gloo's own collectives, as NCCL's are used: zeroray's point-to-point exchange needs a peer.
    return TorchGroup(dist.ProcessGroupGloo(store, 0, 1, timeout), 0, 1, "gloo", point_to_point=False)


def parity_engine(device: str, stage: int, group=None) -> Engine:
    """The engine the parity runs compare: the tests' awkward model, AdamW, fp32."""
    return Engine(parity_model, lm_loss, zr.AdamW(**ADAMW), zr.ZeroConfig(stage=stage), group or SoloGroup(),
                  device=device)


def param_diff(engine: Engine, reference: Dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between the engine's fp32 master pieces and ``reference``."""
    worst = 0.0
    for name, want in reference.items():
        if name in engine.layout.slots:
            lo, hi, piece = engine.master_piece(name)
            worst = max(worst, (piece - want.reshape(-1)[lo:hi].cpu()).abs().max().item())
    return worst


def parity(device: str, backend: Optional[str] = None, failures: Optional[List[str]] = None) -> bool:
    """Stages 0-3 against plain PyTorch on ``device``, through the SoloGroup and a world-1 group of
    ``backend`` (NCCL on CUDA, gloo otherwise); each failing line is appended to ``failures``."""
    backend = backend or ("nccl" if device.startswith("cuda") else "gloo")
    failures = [] if failures is None else failures
    batches = [tuple(t.to(device) for t in b) for b in make_batches(6)]
    torch.manual_seed(0)
    ref = parity_model().to(device)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **ADAMW)
    ref_losses = []
    for b in batches:
        opt.zero_grad()
        loss = lm_loss(ref, b)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    ref_params = {k: p.detach() for k, p in ref.named_parameters()}
    ok = True
    for via in ("solo", backend):
        for stage in range(4):
            group = SoloGroup() if via == "solo" else world1_group(backend)
            engine = parity_engine(device, stage, group)
            losses = [engine.train_step(b).loss for b in batches]
            loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            param_err = param_diff(engine, ref_params)
            engine.close()
            group.close()
            good = loss_err <= TOL and param_err <= TOL
            ok &= good
            line = f"parity {via} stage {stage}: max rel loss diff {loss_err:.2e}, max abs param diff {param_err:.2e}"
            print(f"{line} {'OK' if good else 'FAIL'}", flush=True)
            if not good:
                failures.append(line)
    return ok
