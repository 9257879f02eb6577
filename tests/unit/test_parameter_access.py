"""Seeing parameter reads (fetch/access.py): an op on a parameter outside any hooked module reaches
``on_access`` with its name and unit before it runs; metadata does not count; ``suspend`` and
``install`` turn it off and on; ``remove`` gives the parameters their plain class back."""
import pytest
import torch
import torch.nn.functional as F

from zeroray.fetch.access import ParameterAccess


def setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    params = dict(model.named_parameters())
    seen = []
    access = ParameterAccess(params, {"0.weight": 0, "0.bias": 0, "1.weight": 1, "1.bias": 1},
                             lambda name, unit: seen.append((name, unit)))
    access.install()
    return model, access, seen


def test_reads_reach_on_access_before_the_op_with_name_and_unit():
    model, access, seen = setup()
    w = model[1].weight
    out = w * 2
    assert seen == [("1.weight", 1)]
    assert type(out) is torch.Tensor  # results are plain tensors
    torch.cat([model[0].bias, model[1].bias])  # parameters inside a list argument
    assert seen[1:] == [("0.bias", 0), ("1.bias", 1)]
    torch.add(torch.zeros(1), other=model[1].bias)  # and in keyword arguments
    assert seen[3:] == [("1.bias", 1)]


def test_an_error_from_on_access_stops_the_op():
    model = torch.nn.Linear(3, 2)

    def refuse(name, unit):
        raise LookupError(f"{name} of unit {unit}")
    access = ParameterAccess(dict(model.named_parameters()), {"weight": 4, "bias": 4}, refuse)
    access.install()
    ran = []
    with pytest.raises(LookupError, match="^weight of unit 4$"):
        ran.append(model.weight.sum())
    assert ran == []
    access.remove()


def test_metadata_is_not_a_read_but_data_is():
    model, access, seen = setup()
    w = model[0].weight
    _ = (w.shape, w.size(), w.dim(), w.numel(), w.dtype, w.requires_grad, w.grad, w.is_contiguous())
    assert seen == []
    w.data
    assert seen == [("0.weight", 0)]


def test_a_forward_reads_through_the_module():
    model, access, seen = setup()
    model(torch.ones(1, 3))
    assert set(seen) == {("0.weight", 0), ("0.bias", 0), ("1.weight", 1), ("1.bias", 1)}
    F.linear(torch.ones(1, 3), model[0].weight)
    assert seen[-1] == ("0.weight", 0)


def test_suspend_and_install():
    model, access, seen = setup()
    access.suspend()
    assert {type(p) for p in model.parameters()} == {torch.nn.Parameter}
    model[0].weight.sum()
    assert seen == []
    access.install()
    assert {type(p) for p in model.parameters()} == {access.cls}
    model[0].weight.sum()
    assert seen == [("0.weight", 0)]


def test_remove_restores_the_plain_class_for_good():
    model, access, seen = setup()
    access.remove()
    assert {type(p) for p in model.parameters()} == {torch.nn.Parameter}
    access.install()  # it forgot the parameters: nothing to install on
    model[0].weight.sum()
    assert seen == [] and type(model[0].weight) is torch.nn.Parameter
    assert isinstance(model[0].weight, torch.nn.Parameter) and model[0].weight.requires_grad
