"""offload="disk" ([Note: disk offload] in zeroray/offload/stepper.py) in plain torch processes:
every stage, in fp32 and mixed precision, with clipping, loss scaling, unused parameters and
SGD with momentum, equals the same run with the optimizer state in memory bitwise (losses and
parameters), and single-process PyTorch within the parity tests' tolerance. Chunks of 64
elements, so that every shard steps in several chunks through the three slots. At stage 3 the
parameter shard is on disk too, read ahead of the gathers ([Note: parameter shard on disk] in
zeroray/offload/shard.py): fp32 and bf16, with gradient accumulation and clipping, bitwise the
in-memory run (an evaluation after the steps too, whose negotiated gathers read the shard when
they send it), and no byte of the shard (nor the master) in the memory report."""
import os

import pytest
import torch

import zeroray as zr
from tests.dist.harness import run_engines
from tests.dist.test_engine_parity import assert_parity, ref_adamw, ADAMW
from tests.models import branch_model, lm_loss, make_batches, parity_model, reference_run
from zeroray.engine.batch import split_batch
from zeroray.memory.report import measure

STEPS = 5
CHUNK = 512  # bytes per chunk over Adam's two state tensors: 64 elements


def _spec(stage, batches, offload_dir=None, model_fn=parity_model, optimizer=None, **zero):
    offload = dict(offload="disk", offload_dir=offload_dir, offload_chunk_bytes=CHUNK) if offload_dir else {}
    return dict(model_fn=model_fn, loss_fn=lm_loss, optimizer=optimizer or zr.AdamW(**ADAMW),
                zero=zr.ZeroConfig(stage=stage, **zero, **offload), batches=batches,
                inspect=_inspect)


def _inspect(engine):
    """An evaluation after the steps (stage 3: negotiated gathers, the shard read when sent),
    the disk tier's totals, the master's and the shard's bytes still in memory, and the memory
    report's terms measured and estimated (memory/report.py)."""
    evaluation = engine.evaluate(split_batch(make_batches(1, seed=7)[0], 2)[engine.rank])
    report = measure(engine)
    shard = engine.param_shard.tensors() if engine.param_shard is not None else []
    disk = engine.optimizer.disk
    return {**engine.offload_stats(), "evaluation": evaluation, "master_is_shard_file": disk is not None and disk.shared,
            "master_in_memory": sum(t.numel() for t in engine.master.tensors()),
            "shard_in_memory": sum(t.numel() for t in shard),
            "params_measured": report["measured"]["params"], "params_estimated": report["estimate"]["params"],
            "optimizer_measured": report["measured"]["optimizer"],
            "optimizer_estimated": report["estimate"]["optimizer"], "pieces": len(engine.optimizer.pieces.pieces)}


SGD = dict(lr=0.05, momentum=0.9)
CASES = {  # name -> (zero overrides, model, optimizer, reference or None)
    **{f"stage{s}": (dict(stage=s), parity_model, None, "adamw") for s in range(4)},
    "stage3-unused": (dict(stage=3), branch_model, None, "branch"),
    "stage1-sgd-momentum": (dict(stage=1), parity_model, zr.SGD(**SGD), "sgd"),
    "stage0-bf16-clip": (dict(stage=0, dtype="bf16", max_grad_norm=0.5), parity_model, None, None),
    "stage2-bf16-clip": (dict(stage=2, dtype="bf16", max_grad_norm=0.5), parity_model, None, None),
    "stage3-bf16-accum-clip": (dict(stage=3, dtype="bf16", grad_accum_steps=2, max_grad_norm=0.5), parity_model,
                               None, None),
    "stage3-accum-clip": (dict(stage=3, grad_accum_steps=2, max_grad_norm=0.5), parity_model, None, None),
    "stage1-fp16": (dict(stage=1, dtype="fp16", initial_loss_scale=2.0**17), parity_model, None, None),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    batches = make_batches(STEPS)
    folder = str(tmp_path_factory.mktemp("offload"))
    specs = []
    for name, (zero, model_fn, opt, _) in CASES.items():
        stage = zero.pop("stage")
        for offload_dir in (None, folder):
            specs.append(_spec(stage, batches, offload_dir, model_fn, opt, **zero))
        zero["stage"] = stage
    out = run_engines(2, specs)
    refs = {"adamw": reference_run(parity_model, lm_loss, ref_adamw, batches),
            "branch": reference_run(branch_model, lm_loss, ref_adamw, batches),
            "sgd": reference_run(parity_model, lm_loss, lambda m: torch.optim.SGD(
                [p for p in m.parameters() if p.requires_grad], **SGD), batches)}
    return {name: (out[2 * i], out[2 * i + 1]) for i, name in enumerate(CASES)}, refs, folder


@pytest.mark.parametrize("name", list(CASES))
def test_offload_equals_memory_and_pytorch(runs, name):
    by_name, refs, folder = runs
    (mem_results, mem_params), (off_results, off_params) = by_name[name]
    for mem, off in zip(mem_results, off_results):
        assert mem["losses"] == off["losses"] and mem["norms"] == off["norms"] and mem["skipped"] == off["skipped"]
        assert mem["inspect"]["evaluation"] == off["inspect"]["evaluation"]
    for key, want in mem_params.items():
        assert torch.equal(off_params[key], want), f"{name}: {key} differs from the in-memory run"
    ref = CASES[name][3]
    if ref is not None:
        assert_parity(refs[ref], off_results, off_params)
    stage3 = CASES[name][0]["stage"] == 3
    master_on_disk = CASES[name][0].get("dtype", "fp32") != "fp32" or stage3
    for r in off_results:  # the state went through the files, in several chunks per step
        stats = r["inspect"]
        assert stats["steps"] == sum(not s for s in r["skipped"]) and stats["chunk_elems"] <= 128  # 64 (Adam), 128 (SGD)
        assert stats["bytes_written"] > 0 and (stats["bytes_read"] > 0) == (stats["steps"] > 1 or master_on_disk)
        # mixed precision and stage 3: the fp32 master is in the files too ([Note: master on disk]), read every step
        assert (stats["master_in_memory"] == 0) == master_on_disk
        # fp32 at stage 3: the shard's file is the master's ([Note: parameter shard on disk])
        assert stats["master_is_shard_file"] == (stage3 and CASES[name][0].get("dtype", "fp32") == "fp32")
        if stage3:  # the shard is in its file: none of it in memory between steps, nor in the report
            assert stats["shard_in_memory"] == 0 and stats["params_measured"] == stats["params_estimated"] == 0
            # every gather read its slice from the file; after the first step (negotiated, no
            # trace yet) along the trace, ahead of the gather
            assert stats["shard_bytes_read"] > 0 and stats["shard_bytes_written"] > 0
            assert stats["shard_hits"] > stats["shard_misses"] > 0
        # the memory report's optimizer term: the tier's buffers (estimate) and the 0-dim scalars
        assert stats["optimizer_estimated"] == stats["buffer_bytes"]
        assert 0 <= stats["optimizer_measured"] - stats["buffer_bytes"] <= 4 * stats["pieces"]

    if name == "stage1-fp16":  # the overflowing steps were skipped with the state untouched
        assert any(off_results[0]["skipped"]) and not all(off_results[0]["skipped"])
    assert os.listdir(folder) == []  # every engine removed its scratch folder when it closed
