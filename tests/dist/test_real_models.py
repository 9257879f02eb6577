"""Models zeroray did not write, at stages 1-3 on 2 and 3 workers: exact parity with plain
single-process PyTorch (issue 13).

The models (tests/real_models.py): a GPT built from torch's nn.MultiheadAttention, a
nanoGPT-style model (root-level init, ``x @ wte.weight.t()`` head), transformers' GPT-2 and
Llama from tiny configs, and a saved GPT-2 loaded two ways (``from_pretrained`` in model_fn,
and ``zeroray.hf.pretrained``, whose workers read only their slices). Also: parameters read
in ``loss_fn`` (an L2 penalty over ``model.parameters()``), rotary buffers staying fp32 in
bf16, and a parameter read outside a step raising an error that names it.
"""
import functools

import pytest
import torch

import zeroray as zr
from tests.dist.ddp_run import ddp_spec, fused_adamw
from tests.dist.harness import run_engine_table
from tests.dist.parity import assert_parity, ddp_state, global_losses
from tests.models import reference_run
from tests.real_models import FACTORIES, hf_gpt2, real_batches, real_loss

STEPS = 4
WORLDS = (3, 2)
# eps=1e-5, not AdamW's default 1e-8: attention's key bias (nn.MultiheadAttention's, GPT-2's
# c_attn) has an exactly zero gradient in exact arithmetic (softmax is shift-invariant), so its
# computed gradient is rounding noise (~1e-10), which AdamW at eps=1e-8 normalises into real
# updates of ~lr in any run whose float operations are ordered differently from the reference
# (DDP's too). At eps=1e-5 noise stays noise (updates ~lr * 1e-5) and every other element
# still gets Adam's update.
ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-5)


def ref_adamw(m):
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], **ADAMW)


def l2_loss(model, batch):
    """real_loss plus an L2 penalty over every parameter, read in loss_fn (outside any forward)."""
    return real_loss(model, batch) + 1e-3 * sum((p.float() ** 2).sum() for p in model.parameters())


def _from_pretrained(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


@pytest.fixture(scope="module")
def saved_gpt2(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(11)
    hf_gpt2().save_pretrained(path)
    return str(path)


def _models(saved):
    from zeroray.hf import pretrained

    return {**FACTORIES, "from_pretrained": functools.partial(_from_pretrained, saved),
            "hf.pretrained": pretrained(saved)}


def _specs(saved, world):
    """(name, stage, kind) -> spec: every (model, stage) and the extra cases of one world size."""
    batches = real_batches(STEPS, batch=4 * world)
    specs = {}
    for name, model_fn in _models(saved).items():
        for stage in (1, 2, 3):
            specs[(name, stage, "plain")] = dict(model_fn=model_fn, loss_fn=real_loss, optimizer=zr.AdamW(**ADAMW),
                                                 zero=zr.ZeroConfig(stage=stage), batches=batches)
    for stage in (2, 3):
        specs[("nano", stage, "l2")] = dict(model_fn=FACTORIES["nano"], loss_fn=l2_loss, optimizer=zr.AdamW(**ADAMW),
                                            zero=zr.ZeroConfig(stage=stage), batches=batches)
    # Activation checkpointing at stage 3: recomputation in backward fetches the blocks again
    # (the checkpointed block's own hooks do not fire then), whole blocks and module by module.
    for wrap in ("auto", "module"):
        specs[("mha", 3, f"ckpt-{wrap}")] = dict(
            model_fn=FACTORIES["mha"], loss_fn=real_loss, optimizer=zr.AdamW(**ADAMW),
            zero=zr.ZeroConfig(stage=3, activation_checkpointing=True, wrap=wrap), batches=batches)
    return specs


def _ddp_specs(saved, world):
    """("ddp", reference name, loss kind) -> torch DDP on the same batches: one per reference
    below (every stage and checkpointing setting of a model shares it), the second reference of
    [Note: parity bound] in tests/dist/parity.py."""
    batches = real_batches(STEPS, batch=4 * world)
    models = _models(saved)
    specs = {}
    for name, stage, kind in _specs(saved, world):
        ref_name, loss = _reference_of(name, kind)
        specs[("ddp", ref_name, kind == "l2")] = ddp_spec(model_fn=models[ref_name], loss_fn=loss,
                                                          optimizer=fused_adamw(**ADAMW), batches=batches)
    return specs


def _reference_of(name, kind):
    """(model name, loss_fn) of the single-process reference of a run: zeroray.hf.pretrained's
    weights are the saved ones, so its reference loads them whole."""
    return ("from_pretrained" if name == "hf.pretrained" else name), (l2_loss if kind == "l2" else real_loss)


def _llama_bf16_spec():
    from tests.real_models import hf_llama

    return dict(model_fn=hf_llama, loss_fn=real_loss, optimizer=zr.AdamW(lr=1e-3),
                zero=zr.ZeroConfig(stage=3, dtype="bf16"), batches=real_batches(2, batch=8))


@pytest.fixture(scope="module")
def runs(saved_gpt2):
    """Each world size's runs (zeroray's and torch DDP's) in a set of processes of its own, the
    bf16 Llama run of the test below with the 2-worker ones (start-up, transformers' import
    included, is a set's largest cost): (world, key) -> (results, params)."""
    out = {}
    for world in WORLDS:
        specs = {**_specs(saved_gpt2, world), **_ddp_specs(saved_gpt2, world)}
        table = {(world, key): (world, spec) for key, spec in specs.items()}
        if world == 2:
            table[(2, "llama-bf16")] = (2, _llama_bf16_spec())
        out.update(run_engine_table(table))
    return out


@pytest.mark.timeout(1200)  # the first one sets up the module's runs, torch DDP's among them: ~10 min under load
@pytest.mark.parametrize("world", WORLDS)
def test_models_we_did_not_write_match_pytorch(saved_gpt2, runs, world):
    batches = real_batches(STEPS, batch=4 * world)
    table = []
    refs = {}  # the reference depends on the model and the loss, not on the stage or the checkpointing
    for name, stage, kind in _specs(saved_gpt2, world):
        results, params = runs[(world, (name, stage, kind))]
        ref_name, loss_fn = _reference_of(name, kind)
        if (ref_name, loss_fn) not in refs:
            refs[(ref_name, loss_fn)] = reference_run(_models(saved_gpt2)[ref_name], loss_fn, ref_adamw, batches)
        ref = refs[(ref_name, loss_fn)]
        ddp = runs[(world, ("ddp", ref_name, kind == "l2"))]
        try:
            assert_parity(ref, results, params, ddp=ddp)
        except AssertionError as e:
            raise AssertionError(f"{name} ({kind}), stage {stage}, {world} workers: {e}") from None
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(global_losses(results), ref[0]))
        floats = [k for k, v in ref[2].items() if v.is_floating_point()]
        pairs = ((params, ref[2]), (ddp_state(ddp), ref[2]), (params, ddp_state(ddp)))
        param_err, ddp_err, apart = (max((x[k].reshape(ref[2][k].shape) - y[k]).abs().max().item() for k in floats)
                                     for x, y in pairs)
        table.append(f"{name:16s} {kind:11s} stage {stage}  loss rel {loss_err:.1e}  params abs {param_err:.1e}"
                     f"  (DDP {ddp_err:.1e}, zeroray - DDP {apart:.1e})")
    print(f"\n{world} workers, {STEPS} AdamW steps:\n  " + "\n  ".join(table))


def _touch_in_param_groups(name, p):
    return {"weight_decay": 0.0 if float(p.detach().abs().sum()) > 0 else 0.1}


def test_bf16_keeps_buffers_and_a_parameter_read_between_steps_is_an_error(runs):
    """bf16 keeps Llama's rotary inv_freq buffers in fp32 ([Note: mixed precision] in
    zeroray/engine/precision.py), and training works: transformers computes the rotary angles in fp32
    and casts them itself; and at stage
    3 a parameter read outside a step (here in a param_groups callback, at construction) raises
    ParameterAccessError naming it, instead of reading a freed buffer."""
    from tests.dist.harness import run_engine

    results, _ = runs[(2, "llama-bf16")]  # run with the module's other runs (_llama_bf16_spec)
    for r in results:
        assert r["buffer_dtypes"]["model.rotary_emb.inv_freq"] == torch.float32, r["buffer_dtypes"]
        assert all(abs(x) < 10 for x in r["losses"]), r["losses"]

    with pytest.raises(RuntimeError) as info:
        run_engine(2, model_fn=FACTORIES["mha"], loss_fn=real_loss, optimizer=zr.AdamW(lr=1e-3),
                   zero=zr.ZeroConfig(stage=3), batches=real_batches(1, batch=8),
                   param_groups=_touch_in_param_groups)
    text = str(info.value)
    assert "ParameterAccessError" in text and "'tok.weight'" in text and "outside a training step" in text, text
