"""The optimizer record ([Note: optimizer record] in zeroray/engine/optim_record.py), what a
restore rebuilds from it ([Note: rebuilt from data] in engine/optim_rebuild.py) and what a load
takes of it ([Note: restoring the optimizer] in runtime/controller/optimizer_restore.py), on one engine in
one process (SoloGroup): no Ray. The record goes through JSON text each time, as a manifest
holds it; the restored engine must go on bitwise as the one that saved, on the optimizer path
the saved one took (flat pieces, or whole parameters: [Note: optimizer paths] in
zeroray/engine/optim_choice.py). The same through real Ray workers at stages 0-3:
tests/ray/test_restore_optimizer.py (and tests/ray/test_whole_param_trainer.py for the
whole-parameter path).
"""
import collections
import json
import logging

import pytest
import torch
from torch.optim import lr_scheduler as L

import zeroray as zr
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine
from zeroray.engine.optim import ShardedOptimizer
from zeroray.engine.shaped_optim import WholeParamOptimizer
from zeroray.engine.optim_rebuild import (SCHEDULERS, NamedOverrides, RebuildError, TorchOptimizer, TorchScheduler,
                                          rebuild_optimizer, rebuild_scheduler)
from zeroray.engine.optim_record import (decode, encode, hyperparameters, load_scheduler_state, merge_parts,
                                         scheduler_state, with_plan)
from zeroray.runtime.controller.optimizer_restore import RestoreChoice, choose, plan_load
from tests.models import DIM, VOCAB, lm_loss, make_batches, parity_model
from tests.whole_param_optimizers import Lamb, muon_adamw

BATCHES = make_batches(6, batch=4)


def no_decay(name, param):
    """The usual recipe: no weight decay on biases and norms (reads only the parameter's shape)."""
    return {"weight_decay": 0.0} if param.ndim < 2 else {}


class MyAdam(torch.optim.Adam):
    """A user's own optimizer class: code, which no checkpoint may name for import."""


class Matrices(torch.nn.Module):
    """Every trainable parameter 2-D: what torch.optim.Muon alone takes."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.mid = torch.nn.Linear(DIM, DIM, bias=False)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.emb(idx))))


RECIPES = {
    "zr.AdamW": dict(optimizer=zr.AdamW(lr=1e-2, weight_decay=0.0)),
    "SGD nesterov, groups, StepLR": dict(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
        param_groups=lambda name, p: {"lr": 0.05, "weight_decay": 1e-3} if p.ndim < 2 else {},
        scheduler=lambda opt: L.StepLR(opt, step_size=2, gamma=0.5)),
    "Adam, no-decay groups, OneCycleLR (cycles betas)": dict(
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1), param_groups=no_decay,
        scheduler=lambda opt: L.OneCycleLR(opt, max_lr=0.05, total_steps=20)),
    "RMSprop, CosineAnnealingWarmRestarts": dict(
        optimizer=lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5),
        scheduler=lambda opt: L.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=2)),
    "zr.SGD, MultiStepLR": dict(optimizer=zr.SGD(lr=0.1, momentum=0.9),
                                scheduler=lambda opt: L.MultiStepLR(opt, milestones=[2, 4, 4], gamma=0.5)),
    # whole parameters: torch classes that are not element-wise, rebuilt from data
    "Adafactor, no-decay groups, StepLR": dict(
        optimizer=lambda p: torch.optim.Adafactor(p, lr=1e-2, weight_decay=0.1), param_groups=no_decay,
        scheduler=lambda opt: L.StepLR(opt, step_size=2, gamma=0.5)),
    "Muon on a model of matrices": dict(optimizer=lambda p: torch.optim.Muon(p, lr=0.02, weight_decay=0.01),
                                        model_fn=Matrices),
    # a declaration is kept: Adafactor declared element-wise runs on flat pieces, and so must its restore
    "zr.elementwise(Adafactor)": dict(optimizer=zr.elementwise(lambda p: torch.optim.Adafactor(p, lr=1e-2))),
}


def engine(optimizer=None, param_groups=None, scheduler=None, stage=0, model_fn=parity_model):
    return Engine(model_fn, lm_loss, optimizer or zr.AdamW(), zr.ZeroConfig(stage=stage), SoloGroup(),
                  param_groups=param_groups, scheduler=scheduler)


def as_saved(e, recipe):
    """What a checkpoint of ``e`` holds: its state and its optimizer record, through JSON text."""
    tensors, scalars = e.export_state()
    record = merge_parts([e.optimizer_record()], recipe.get("optimizer"), recipe.get("param_groups"))
    return ({k: v.clone() for k, v in tensors.items()}, json.loads(json.dumps(scalars)),
            json.loads(json.dumps(record)))


def restored(saved, choice_given=None, fresh=False, stage=0, model_fn=parity_model):
    """A new engine as Trainer.restore builds and loads it (choose, then plan_load, then import)."""
    tensors, scalars, record = saved
    choice = choose(record, "ckpt", choice_given or {}, fresh)
    e = engine(choice.optimizer, choice.param_groups, choice.scheduler, stage=stage, model_fn=model_fn)
    live = merge_parts([e.optimizer_record()], choice.optimizer, choice.param_groups)
    plan = plan_load(record, [scalars], live, choice, fresh)
    e.import_state(*with_plan(tensors, scalars, plan.for_workers()))
    return e, plan


def train(e, batches):
    for b in batches:
        e.train_step(b)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("stage", [0, 3])
def test_restored_without_restating_goes_on_bitwise(name, stage):
    recipe = RECIPES[name]
    saving = engine(**recipe, stage=stage)
    train(saving, BATCHES[:3])
    saved = as_saved(saving, recipe)
    again, plan = restored(saved, stage=stage, model_fn=recipe.get("model_fn", parity_model))
    assert plan.lines and plan.lines[0].endswith("all from the checkpoint"), plan.lines
    assert type(again.optimizer) is type(saving.optimizer)  # the same path
    before = [dict(g) for g in again.optimizer.inner.param_groups]
    assert [hyperparameters(g) for g in before] == [hyperparameters(g) for g in saving.optimizer.inner.param_groups]
    train(saving, BATCHES[3:])
    train(again, BATCHES[3:])
    assert torch.equal(again.master_shard(), saving.master_shard())
    assert [hyperparameters(g) for g in again.optimizer.inner.param_groups] == \
        [hyperparameters(g) for g in saving.optimizer.inner.param_groups]


def test_the_record_says_what_was_built():
    recipe = RECIPES["SGD nesterov, groups, StepLR"]
    e = engine(**recipe)
    train(e, BATCHES[:3])
    record = as_saved(e, recipe)[2]
    assert record["class"] == "torch.optim.sgd.SGD" and record["spec"]["kind"] == "callable"
    assert record["defaults"]["nesterov"] is True and record["defaults"]["momentum"] == 0.9
    assert record["state_keys"] == ["momentum_buffer"]
    by_overrides = {json.dumps(g["overrides"], sort_keys=True): g for g in record["groups"]}
    small = by_overrides[json.dumps({"lr": 0.05, "weight_decay": 1e-3}, sort_keys=True)]
    assert "norm.weight" in small["params"] and "emb.weight" not in small["params"]
    assert small["initial"]["lr"] == 0.05 and small["current"]["lr"] == 0.05 * 0.5  # StepLR stepped at 2
    assert record["scheduler"]["class"] == "torch.optim.lr_scheduler.StepLR"
    assert record["scheduler"]["current"]["last_epoch"] == 3 and record["scheduler"]["initial"]["last_epoch"] == 0
    assert "base_lrs" not in record["scheduler"]["current"]
    zr_record = as_saved(engine(optimizer=zr.AdamW(lr=1e-2, weight_decay=0.0)), {"optimizer": zr.AdamW(lr=1e-2,
                                                                                                       weight_decay=0.0)})[2]
    assert zr_record["spec"] == {"kind": "zeroray", "class": "AdamW",
                                 "fields": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}}
    assert rebuild_optimizer(zr_record) == zr.AdamW(lr=1e-2, weight_decay=0.0)


def test_values_round_trip_through_json():
    for value in [None, True, 3, 0.1, float("inf"), "cos", (0.9, 0.999), (None, 1e-3), {"a": [1, 2]},
                  collections.Counter({2: 1, 5: 2})]:
        ok, encoded = encode(value)
        assert ok, value
        back = decode(json.loads(json.dumps(encoded)), tuples=isinstance(value, tuple))
        assert back == value and type(back) is type(value), (value, back)
    for value in [torch.tensor(0.1), object(), {1: 2}, [torch.zeros(1)]]:
        assert encode(value) == (False, None)


def test_a_tensor_hyperparameter_is_listed_as_unrecorded_and_refused():
    spec = lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-2))  # noqa: E731
    record = as_saved(engine(optimizer=spec), {"optimizer": spec})[2]
    assert record["unrecorded"] == ["lr"]
    with pytest.raises(RebuildError, match=r"not data \(lr\).*optimizer="):
        choose(record, "ckpt", {})
    choose(record, "ckpt", {"optimizer": spec})  # restated: fine


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_scheduler_rebuilt_from_its_record_goes_on_as_the_original(name):
    """Each of SCHEDULERS, stepped 7 times, recorded (through JSON), rebuilt on a new optimizer
    and loaded as a restore loads it: the next 12 steps' lr and momentum are the original's."""
    def make(opt):
        return {"StepLR": lambda: L.StepLR(opt, 3, 0.5), "MultiStepLR": lambda: L.MultiStepLR(opt, [2, 9, 9], 0.5),
                "ConstantLR": lambda: L.ConstantLR(opt, 0.5, 9), "LinearLR": lambda: L.LinearLR(opt, 0.2, 1.0, 10),
                "ExponentialLR": lambda: L.ExponentialLR(opt, 0.9), "PolynomialLR": lambda: L.PolynomialLR(opt, 12, 2.0),
                "CosineAnnealingLR": lambda: L.CosineAnnealingLR(opt, 6, 1e-3),
                "CosineAnnealingWarmRestarts": lambda: L.CosineAnnealingWarmRestarts(opt, 3, 2, 1e-3),
                "OneCycleLR": lambda: L.OneCycleLR(opt, [0.5, 0.3], total_steps=25, pct_start=0.4,
                                                   three_phase=True)}[name]()

    def optimizer():
        p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
        return torch.optim.SGD([{"params": [p]}, {"params": [q], "lr": 0.05}], lr=0.1, momentum=0.9)

    original_opt = optimizer()
    original = make(original_opt)
    for _ in range(7):
        original_opt.step()
        original.step()
    state = json.loads(json.dumps(scheduler_state(original)))
    groups = json.loads(json.dumps([hyperparameters(g) for g in original_opt.param_groups]))
    rebuilt = rebuild_scheduler({"class": f"torch.optim.lr_scheduler.{name}", "name": "s", "current": state,
                                 "unrecorded": []})
    assert isinstance(rebuilt, TorchScheduler)
    again_opt = optimizer()
    again = rebuilt(again_opt)
    for g, values in zip(again_opt.param_groups, groups):
        g.update({k: decode(v, tuples=True) for k, v in values.items()})
    load_scheduler_state(again, state)
    for _ in range(12):
        original_opt.step(), again_opt.step()
        original.step(), again.step()
        assert [(g["lr"], g["momentum"]) for g in again_opt.param_groups] == \
            [(g["lr"], g["momentum"]) for g in original_opt.param_groups]


@pytest.mark.parametrize("make", [
    lambda opt: L.LambdaLR(opt, lambda step: 0.9 ** step),
    lambda opt: L.SequentialLR(opt, [L.ConstantLR(opt, 0.5, 2), L.StepLR(opt, 2)], milestones=[2]),
    lambda opt: L.CyclicLR(opt, 0.01, 0.1),
])
def test_a_scheduler_that_is_code_is_refused_before_anything_starts(make):
    recipe = dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), scheduler=make)
    e = engine(**recipe)
    train(e, BATCHES[:2])
    record = as_saved(e, recipe)[2]
    with pytest.raises(RebuildError, match=r"scheduler=lambda opt: \w+\(opt, \.\.\.\)"):
        choose(record, "ckpt", {})
    assert choose(record, "ckpt", {"scheduler": make}).scheduler is make


def test_a_users_own_optimizer_class_is_refused_and_a_group_changing_callable_too():
    for spec in (lambda p: MyAdam(p, lr=1e-2),
                 lambda groups: torch.optim.SGD([{**g, "lr": 0.5} for g in groups], lr=0.1)):
        e = engine(optimizer=spec)
        record = as_saved(e, {"optimizer": spec})[2]
        with pytest.raises(RebuildError) as raised:
            choose(record, "ckpt", {})
        assert "optimizer=" in str(raised.value)
    assert "MyAdam" in json.dumps(as_saved(engine(optimizer=lambda p: MyAdam(p)), {})[2]["class"])


def test_restating_a_different_lr_is_taken_and_logged_and_the_rest_continues():
    """The scheduler had moved lr; restating another initial lr replaces it, weight decay (not
    restated: the same initial value) keeps the checkpoint's, and the state loads."""
    opt = lambda lr: (lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.0))  # noqa: E731
    sched = lambda o: L.StepLR(o, step_size=1, gamma=0.5)  # noqa: E731
    recipe = dict(optimizer=opt(1e-2), scheduler=sched)
    e = engine(**recipe)
    train(e, BATCHES[:3])
    saved = as_saved(e, recipe)
    again, plan = restored(saved, {"optimizer": opt(1e-3), "scheduler": sched})
    assert plan.lines == ("restore: optimizer AdamW: lr 0.00125 -> 0.001 (from optimizer= given to restore)",)
    assert again.optimizer.inner.param_groups[0]["lr"] == 1e-3
    assert again.optimizer.scheduler.last_epoch == 3
    assert torch.equal(again.optimizer.inner.state[again.optimizer.flat_params[0]]["exp_avg"],
                       e.optimizer.inner.state[e.optimizer.flat_params[0]]["exp_avg"])
    same, plan = restored(saved, {"optimizer": opt(1e-2), "scheduler": sched})
    assert plan.lines == () and same.optimizer.inner.param_groups[0]["lr"] == 1e-2 * 0.5 ** 3


def test_a_zeroray_spec_restated_with_another_weight_decay():
    saved = as_saved((lambda e: (train(e, BATCHES[:2]), e)[1])(engine(zr.AdamW(lr=1e-2, weight_decay=0.0))),
                     {"optimizer": zr.AdamW(lr=1e-2, weight_decay=0.0)})
    again, plan = restored(saved, {"optimizer": zr.AdamW(lr=1e-3)})
    assert plan.lines == ("restore: optimizer AdamW: lr 0.01 -> 0.001, weight_decay 0.0 -> 0.01 "
                          "(from optimizer= given to restore)",)
    assert again.optimizer.inner.param_groups[0]["weight_decay"] == 0.01


def test_restated_param_groups_change_one_group_only():
    recipe = dict(optimizer=zr.AdamW(lr=1e-2), param_groups=no_decay)
    e = engine(**recipe)
    train(e, BATCHES[:2])
    saved = as_saved(e, recipe)
    again, plan = restored(saved, {"param_groups": lambda n, p: {"weight_decay": 0.5} if p.ndim < 2 else {}})
    assert len(plan.lines) == 1 and "weight_decay 0.0 -> 0.5 (from param_groups= given to restore)" in plan.lines[0]
    assert "norm.weight" in plan.lines[0] or "+" in plan.lines[0]
    assert sorted(g["weight_decay"] for g in again.optimizer.inner.param_groups) == [0.01, 0.5]


def test_another_optimizer_whose_state_does_not_fit_needs_fresh_optimizer():
    recipe = dict(optimizer=zr.SGD(lr=0.1, momentum=0.9))
    e = engine(**recipe)
    train(e, BATCHES[:2])
    saved = as_saved(e, recipe)
    with pytest.raises(ValueError, match="does not fit it. Pass fresh_optimizer=True"):
        choose(saved[2], "ckpt", {"optimizer": zr.AdamW()})
    again, plan = restored(saved, {"optimizer": zr.AdamW(lr=1e-3)}, fresh=True)
    assert "starts fresh" in plan.lines[0] and not again.optimizer.inner.state
    assert torch.equal(again.master_shard(), e.master_shard())  # the weights still load
    # Adam -> AdamW: the same state keys, so the moments load, and the log names the change
    adam = dict(optimizer=zr.Adam(lr=1e-2))
    e = engine(**adam)
    train(e, BATCHES[:2])
    again, plan = restored(as_saved(e, adam), {"optimizer": zr.AdamW(lr=1e-2, weight_decay=0.0)})
    assert plan.lines[0].startswith("restore: optimizer Adam -> AdamW")
    assert again.optimizer.inner.state[again.optimizer.flat_params[0]]["step"] == 2


def test_a_checkpoint_without_a_record_takes_the_given_optimizer_or_warns(caplog):
    e = engine(zr.AdamW(lr=1e-2, weight_decay=0.0))
    train(e, BATCHES[:2])
    tensors, scalars = e.export_state()
    old = {k: v for k, v in scalars.items() if k != "groups"}
    old["group_lr"] = {key: g["lr"] for key, g in scalars["groups"].items()}
    caplog.set_level(logging.WARNING, logger="zeroray")
    choice = choose(None, "old_ckpt", {})
    assert choice.optimizer == zr.AdamW() and "old_ckpt does not say which optimizer" in caplog.text
    given = choose(None, "old_ckpt", {"optimizer": zr.AdamW(lr=1e-2, weight_decay=0.0)})
    plan = plan_load(None, [old], {}, given)
    again = engine(given.optimizer)
    again.import_state(*with_plan(tensors, old, plan.for_workers()))
    train(e, BATCHES[2:])
    train(again, BATCHES[2:])
    assert torch.equal(again.master_shard(), e.master_shard())


def test_named_overrides_and_torch_optimizer_pickle_and_rebuild():
    import pickle

    for obj in (TorchOptimizer("SGD", {"lr": 0.1}), NamedOverrides({"a": {"betas": [0.9, 0.95]}}),
                TorchScheduler("StepLR", {"step_size": 2})):
        assert pickle.loads(pickle.dumps(obj)) == obj
    assert NamedOverrides({"a": {"betas": [0.9, 0.95]}})("a", None) == {"betas": (0.9, 0.95)}
    assert RestoreChoice(zr.AdamW()).given == {"optimizer", "param_groups", "scheduler"}


def test_pytorch_load_state_dict_brings_back_the_hyperparameters():
    """The rule restore follows, in PyTorch: loading an optimizer's state_dict into one built with
    other hyperparameters gives the saved ones back (and a scheduler's its position)."""
    p = torch.nn.Parameter(torch.zeros(2))
    saved = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.0)
    sched = L.StepLR(saved, step_size=1, gamma=0.5)
    p.grad = torch.ones(2)
    saved.step(), sched.step()
    default = torch.optim.AdamW([p])
    default_sched = L.StepLR(default, step_size=1, gamma=0.5)
    default.load_state_dict(saved.state_dict())
    default_sched.load_state_dict(sched.state_dict())
    assert (default.param_groups[0]["weight_decay"], default.param_groups[0]["lr"]) == (0.0, 5e-3)
    assert default_sched.last_epoch == 1


def test_the_record_goes_through_a_manifest_and_inspect_shows_it(tmp_path):
    import io

    from zeroray.checkpoint import ManifestFields, cli_inspect, commit, load_manifest, load_resharded, write_shard

    recipe = RECIPES["SGD nesterov, groups, StepLR"]
    e = engine(**recipe)
    train(e, BATCHES[:3])
    tensors, scalars = e.export_state()
    record = merge_parts([e.optimizer_record()], recipe["optimizer"], recipe["param_groups"])
    layout = e.state_layout()[0]
    commit(tmp_path, 3, ManifestFields(layout=layout, optimizer=record), [write_shard(tmp_path, 3, 0, tensors, scalars)])
    manifest = load_manifest(tmp_path)
    assert manifest.optimizer == json.loads(json.dumps(record))
    out = io.StringIO()
    assert cli_inspect(tmp_path, out=out) == 0
    text = out.getvalue()
    assert "optimizer: torch.optim.sgd.SGD, built by tests.unit.test_optimizer_record.<lambda>" in text
    assert "state keys: momentum_buffer" in text and "param groups: 2" in text
    assert 'overrides {"lr": 0.05, "weight_decay": 0.001}:' in text and '"lr": 0.025' in text
    assert 'scheduler: torch.optim.lr_scheduler.StepLR: {"_get_lr_called_within_step": false' in text
    # and restored from the files: the same as straight from the engine
    choice = choose(manifest.optimizer, manifest.source, {})
    again = engine(choice.optimizer, choice.param_groups, choice.scheduler)
    live = merge_parts([again.optimizer_record()], choice.optimizer, choice.param_groups)
    loaded = load_resharded(tmp_path, again.state_layout()[0], 0)
    again.import_state(*with_plan(*loaded, plan_load(manifest.optimizer, manifest.scalars, live, choice).for_workers()))
    train(e, BATCHES[3:])
    train(again, BATCHES[3:])
    assert torch.equal(again.master_shard(), e.master_shard())


def test_a_load_whose_record_differs_from_what_was_rebuilt_is_refused():
    """A fallback restore builds from the newest checkpoint's record; an older one it falls back
    to may have been saved with another optimizer: that is not taken for a restatement."""
    first = dict(optimizer=zr.AdamW(lr=1e-2))
    e = engine(**first)
    train(e, BATCHES[:2])
    newest = as_saved(e, first)[2]
    other = dict(optimizer=zr.AdamW(lr=1e-3))
    older = as_saved(engine(**other), other)
    choice = choose(newest, "ckpt", {})
    again = engine(choice.optimizer)
    live = merge_parts([again.optimizer_record()], choice.optimizer, None)
    with pytest.raises(ValueError, match="saved with another optimizer than the one restore rebuilt"):
        plan_load(older[2], [older[1]], live, choice)


@pytest.mark.parametrize("damage", [lambda r: r.pop("groups"), lambda r: r.update(version=99),
                                    lambda r: r["groups"][0].update(params="emb.weight")])
def test_a_damaged_record_says_so(damage):
    recipe = RECIPES["zr.AdamW"]
    record = as_saved(engine(**recipe), recipe)[2]
    damage(record)
    with pytest.raises(ValueError, match="ckpt: the checkpoint's optimizer record is damaged"):
        choose(record, "ckpt", {})


def test_a_restated_scheduler_takes_its_new_arguments_and_the_saved_position():
    """StepLR(step_size=2) saved after 3 steps, restated as StepLR(step_size=3): step_size 3, the
    step count 3 (so the next decay comes at step 6); one of another class starts over."""
    opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    recipe = dict(optimizer=opt, scheduler=lambda o: L.StepLR(o, step_size=2, gamma=0.5))
    e = engine(**recipe)
    train(e, BATCHES[:3])
    saved = as_saved(e, recipe)
    again, plan = restored(saved, {"optimizer": opt, "scheduler": lambda o: L.StepLR(o, step_size=3, gamma=0.5)})
    assert plan.lines == ("restore: scheduler StepLR: step_size 2 -> 3 (from scheduler= given to restore); "
                          "its step counts load",)
    sched = again.optimizer.scheduler
    assert (sched.step_size, sched.last_epoch, again.optimizer.inner.param_groups[0]["lr"]) == (3, 3, 0.05)
    other, plan = restored(saved, {"optimizer": opt, "scheduler": lambda o: L.ExponentialLR(o, gamma=0.9)})
    assert plan.lines == ("restore: scheduler ExponentialLR (from scheduler= given to restore) starts from its "
                          "beginning (the checkpoint's StepLR)",)
    assert other.optimizer.scheduler.last_epoch == 0 and other.optimizer.inner.param_groups[0]["lr"] == 0.1


def test_the_whole_parameter_path_is_recorded_and_refused_or_rebuilt_as_the_flat_one():
    """Adafactor takes the whole-parameter path and is rebuilt onto it; a user's recipe class
    (the Muon recipe, one optimizer) is code: restore says to restate it, and restated it goes
    on bitwise; a declared element-wise callable is recorded as declared, and one whose class
    is the user's is refused with the declaration in the example."""
    recipe = RECIPES["Adafactor, no-decay groups, StepLR"]
    e = engine(**recipe)
    assert isinstance(e.optimizer, WholeParamOptimizer)
    train(e, BATCHES[:3])
    tensors, scalars, record = as_saved(e, recipe)
    assert record["class"] == "torch.optim.Adafactor" and record["spec"]["kind"] == "callable"
    assert record["state_keys"] == ["col_var", "row_var", "step"]  # factored: the probe parameter is 2-D
    assert {json.dumps(g["overrides"]) for g in record["groups"]} == {"{}", '{"weight_decay": 0.0}'}
    assert scalars["optim_path"] == "whole_params" and scalars["groups"] and scalars["scheduler"]["last_epoch"] == 3
    assert any(k.startswith("param_state/") and k.endswith("/row_var") for k in tensors)

    recipe = dict(optimizer=muon_adamw)
    e = engine(**recipe)
    train(e, BATCHES[:3])
    saved = as_saved(e, recipe)
    assert saved[2]["class"] == "tests.whole_param_optimizers.MuonAdamW"
    with pytest.raises(RebuildError, match=r"MuonAdamW.*not one of torch.optim's own classes.*optimizer=lambda params"):
        choose(saved[2], "ckpt", {})
    again, _ = restored(saved, {"optimizer": muon_adamw})
    train(e, BATCHES[3:])
    train(again, BATCHES[3:])
    assert torch.equal(again.master_shard(), e.master_shard())

    declared = zr.elementwise(lambda p: torch.optim.Adam(p, lr=1e-2))
    record = as_saved(engine(declared), {"optimizer": declared})[2]
    assert record["spec"]["kind"] == "elementwise" and record["spec"]["name"].endswith(".<locals>.<lambda>")
    rebuilt = rebuild_optimizer(record)
    assert rebuilt == zr.elementwise(TorchOptimizer("Adam", rebuilt.fn.kwargs)) and rebuilt.fn.kwargs["lr"] == 1e-2
    own = zr.elementwise(lambda p: MyAdam(p, lr=1e-2))
    record = as_saved(engine(own), {"optimizer": own})[2]
    with pytest.raises(RebuildError, match=r"optimizer=zr.elementwise\(lambda params: MyAdam\(params, \.\.\.\)\)"):
        choose(record, "ckpt", {})


def test_a_whole_parameter_state_into_a_flat_optimizer_needs_fresh_optimizer():
    """LAMB's state keys are AdamW's, but they are whole parameters' state: zr.AdamW restated
    cannot take them (flat pieces), and says so; fresh_optimizer=True starts it fresh. Adafactor's
    keys do not fit AdamW's at all: refused before anything is built."""
    recipe = dict(optimizer=lambda p: Lamb(p, lr=1e-2))
    e = engine(**recipe)
    train(e, BATCHES[:2])
    saved = as_saved(e, recipe)
    with pytest.raises(ValueError, match="stepped on whole parameters.*pass fresh_optimizer=True"):
        restored(saved, {"optimizer": zr.AdamW()})
    again, plan = restored(saved, {"optimizer": zr.AdamW(lr=1e-3)}, fresh=True)
    assert isinstance(again.optimizer, ShardedOptimizer) and not again.optimizer.inner.state
    assert torch.equal(again.master_shard(), e.master_shard())
    recipe = RECIPES["Adafactor, no-decay groups, StepLR"]
    e = engine(**recipe)
    train(e, BATCHES[:2])
    with pytest.raises(ValueError, match="does not fit it. Pass fresh_optimizer=True"):
        choose(as_saved(e, recipe)[2], "ckpt", {"optimizer": zr.AdamW()})
