"""Model code ships itself ([Note: shipping model code]): a model and loss defined in a module beside
the driver script train on workers that cannot import that module, with no call by the user."""
import os
import subprocess
import sys
import textwrap

import ray.cloudpickle
import torch

import zeroray as zr
from zeroray.runtime.code_shipping import ship_by_value

MODEL = '''
import torch
import torch.nn as nn

import helpers  # a second module of the user's, used by this one


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11)

    def forward(self, idx):
        return self.head(helpers.squash(self.emb(idx)))


def loss_fn(model, batch):
    import importlib.util
    import os
    # On the workers the model code arrived by value: its module is not importable there.
    if os.environ.get("ZR_EXPECT_NO_IMPORT") and importlib.util.find_spec("mymodel") is not None:
        raise AssertionError("the worker can import mymodel: the test proves nothing")
    idx, tgt = batch
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
'''

HELPERS = '''
import torch


def squash(x):
    return torch.tanh(x)
'''

DRIVER = '''
import os
import sys

import mymodel  # beside this script

# A cluster's workers have no copy of this directory: take it off the path Ray gives the workers
# (Ray adds the script's directory, and the current one, when they are on the driver's path).
sys.path.remove(os.path.dirname(os.path.realpath(__file__)))

import ray
import torch

import zeroray as zr

ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"ZR_EXPECT_NO_IMPORT": "1"}})
g = torch.Generator().manual_seed(0)
batches = [(torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g)) for _ in range(3)]
with zr.Trainer(mymodel.TinyNet, mymodel.loss_fn, zero=zr.ZeroConfig(stage=3),
                scaling=zr.ScalingConfig(num_workers=2)) as trainer:
    losses = [r.loss for r in trainer.fit(batches, progress=False)]
print("TRAINED", losses)
'''


def test_a_module_beside_the_driver_script_reaches_the_workers(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "mymodel.py").write_text(MODEL)
    (code / "helpers.py").write_text(HELPERS)
    (code / "driver.py").write_text(textwrap.dedent(DRIVER))
    elsewhere = tmp_path / "run"  # the driver's working directory, which Ray also puts on the workers' path
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    out = subprocess.run([sys.executable, str(code / "driver.py")], cwd=elsewhere, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "TRAINED" in out.stdout, out.stdout[-3000:]
    print("\n  " + out.stdout.strip().splitlines()[-1])


def test_what_is_shipped_by_value(tmp_path, monkeypatch):
    """The user's modules (and those they use), never zeroray, torch or the standard library."""
    (tmp_path / "zr_ship_a.py").write_text("import zr_ship_b\nimport torch\n\ndef model_fn():\n"
                                           "    return zr_ship_b.Net()\n")
    (tmp_path / "zr_ship_b.py").write_text("import torch\n\nclass Net(torch.nn.Linear):\n"
                                           "    def __init__(self):\n        super().__init__(2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import zr_ship_a

    try:
        # zr_ship_b only through zr_ship_a's code; the optimizer lambda's module (this test's) too.
        shipped = ship_by_value({"model_fn": zr_ship_a.model_fn, "loss_fn": torch.nn.functional.mse_loss,
                                 "optimizer": lambda params: torch.optim.SGD(params, lr=0.1)})
        assert sorted(shipped) == ["tests", "zr_ship_a", "zr_ship_b"]
        assert ship_by_value({"model_fn": torch.nn.Linear, "loss_fn": os.path.join,
                              "zero": zr.ZeroConfig(activation_checkpointing=(torch.nn.Linear,))}) == []
    finally:
        for name in ("zr_ship_a", "zr_ship_b"):
            ray.cloudpickle.unregister_pickle_by_value(sys.modules.pop(name))


def test_a_module_that_arrived_by_value_is_shipped_on(tmp_path, monkeypatch):
    """A Ray Tune trial's function arrives by value with the user's module in its globals, as a
    module object no import made (not in sys.modules); the Trainer it builds ships that module on:
    cloudpickle sends it by value again, and registering it (which cloudpickle refuses) is skipped."""
    (tmp_path / "zr_ship_c.py").write_text("import torch\n\ndef model_fn():\n    return torch.nn.Linear(2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import zr_ship_c

    try:
        ray.cloudpickle.register_pickle_by_value(zr_ship_c)
        train = eval("lambda: zr_ship_c.model_fn()", {"zr_ship_c": zr_ship_c})
        arrived = ray.cloudpickle.loads(ray.cloudpickle.dumps(train))  # what a trial process unpickles
        ray.cloudpickle.unregister_pickle_by_value(sys.modules.pop("zr_ship_c"))
        module = arrived.__globals__["zr_ship_c"]
        assert module is not zr_ship_c and "zr_ship_c" not in sys.modules  # a module no import made
        assert ship_by_value({"model_fn": arrived}) == []  # before the fix: ValueError "not imported correctly"
        again = ray.cloudpickle.loads(ray.cloudpickle.dumps(arrived))
        assert isinstance(again(), torch.nn.Linear)  # it still travels, by value
    finally:
        sys.modules.pop("zr_ship_c", None)
