"""The ``zeroray`` command, called in-process through ``main(argv)``."""
import sys
import types

import pytest
import torch

from zeroray.cli import main


def tiny_model():
    """12 + 4 + 4 = 20 unique parameters, one of them tied."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1, bias=False))
    model.append(torch.nn.Linear(4, 1, bias=False))
    model[2].weight = model[1].weight
    return model


def _rows(text, title_word):
    """The table whose title contains ``title_word``: {workers: [cells...]}."""
    block = text.split(title_word, 1)[1].split("\n\n")[0].splitlines()[2:]
    return {int(line.split()[0]): line.split()[1:] for line in block}


def test_estimate_paper_table(capsys):
    assert main(["estimate", "--params", "7.5e9", "--workers", "1,4,16,64", "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out, "Model states")
    assert rows[64] == ["120.0", "31.4", "16.6", "1.9"]
    assert rows[1] == ["120.0"] * 4
    assert set(rows) == {1, 4, 16, 64}
    assert "K=12" in out and "stage 3" in out


def test_estimate_offload(capsys):
    """--offload disk: the optimizer term (K) leaves memory for the disk tier's three chunks, and at stage 3
    the parameter shard too; --offload cpu (GPU host memory, on paper) leaves the device the same."""
    assert main(["estimate", "--params", "7.5e9", "--workers", "64", "--dtype", "fp16", "--offload", "disk"]) == 0
    out = capsys.readouterr().out
    chunks = 3 * 16 * 2**20 / 1e9  # three slots, each a 16 MiB chunk over the state's two files and the master's
    assert "offload=disk" in out
    assert _rows(out, "Model states")[64] == [f"{2 * 7.5 + 2 * 7.5 + chunks:.1f}", f"{2 * 7.5 + 2 * 7.5 + chunks:.1f}",
                                              f"{2 * 7.5 + 2 * 7.5 / 64 + chunks:.1f}", "0.285"]
    assert main(["estimate", "--params", "7.5e9", "--workers", "64", "--dtype", "fp16", "--offload", "cpu"]) == 0
    cpu = capsys.readouterr().out
    assert "not built yet" in cpu and _rows(cpu, "Model states")[64] == _rows(out, "Model states")[64]
    assert main(["plan", "--model", "llama-7b", "--gpus", "8", "--offload", "cpu"]) == 0
    assert "offload=cpu (on paper: not built yet)" in capsys.readouterr().out


def test_estimate_memory_budget_table(capsys):
    assert main(["estimate", "--params", "7.5B", "--workers", "64", "--memory-gb", "32"]) == 0
    rows = _rows(capsys.readouterr().out, "Largest model")
    assert rows[64] == ["2.0", "7.6", "14.4", "128.0"]


def test_estimate_fp32_sgd(capsys):
    assert main(["estimate", "--params", "1e9", "--workers", "2", "--dtype", "fp32",
                 "--optimizer", "sgd"]) == 0
    out = capsys.readouterr().out
    assert "K=0" in out
    # K = 0: sharding the (empty) optimizer state saves nothing.
    assert _rows(out, "Model states")[2] == ["8.0", "8.0", "6.0", "4.0"]


def test_estimate_model_spec(capsys):
    assert main(["estimate", "--model", f"{__name__}:tiny_model", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "20 params" in out
    assert _rows(out, "Model states")[1] == [f"{16 * 20 / 1e9:.3g}"] * 4


def test_estimate_activations(capsys):
    argv = ["estimate", "--params", "1e9", "--workers", "1,8", "--layers", "24", "--hidden", "1024",
            "--seq-len", "1024", "--batch", "8", "--heads", "16"]
    assert main(argv) == 0
    rows = _rows(capsys.readouterr().out, "Activation memory")
    none, ckpt, part, off = (float(v) for v in rows[8])
    assert none > ckpt > part > off
    assert rows[1][1] == rows[1][2]  # one worker: partitioning changes nothing


@pytest.mark.parametrize("argv", [
    ["estimate"],                                              # neither --params nor --model
    ["estimate", "--params", "7.5e9", "--model", "m:f"],      # both
    ["estimate", "--params", "lots"],
    ["estimate", "--params", "-1"],
    ["estimate", "--params", "1e9", "--workers", "0,4"],
    ["estimate", "--params", "1e9", "--dtype", "fp8"],
    ["estimate", "--params", "1e9", "--optimizer", "lion"],
    ["estimate", "--params", "1e9", "--memory-gb", "0"],
    ["estimate", "--params", "1e9", "--layers", "2"],          # activations need all four
    ["estimate", "--model", "no_such_module_xyz:build"],
    ["estimate", "--model", "not-a-spec"],
    ["frobnicate"],
    [],
])
def test_bad_arguments_exit_2(argv, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "error" in captured.err and captured.out == ""


def test_help_exits_0(capsys):
    assert main(["estimate", "--help"]) == 0
    assert "--memory-gb" in capsys.readouterr().out


def test_checkpoint_commands_delegate(monkeypatch):
    calls = []
    fake = types.ModuleType("zeroray.checkpoint")
    fake.cli_inspect = lambda path: calls.append(("inspect", path)) or 0
    fake.cli_consolidate = lambda path, out: calls.append(("consolidate", path, out)) or 3
    monkeypatch.setitem(sys.modules, "zeroray.checkpoint", fake)
    assert main(["inspect", "ckpts/step_10"]) == 0
    assert main(["consolidate", "ckpts/step_10", "model.pt"]) == 3
    assert calls == [("inspect", "ckpts/step_10"), ("consolidate", "ckpts/step_10", "model.pt")]


def test_checkpoint_commands_missing_tools(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "zeroray.checkpoint", types.ModuleType("zeroray.checkpoint"))
    assert main(["inspect", "ckpt"]) == 2
    assert main(["consolidate", "ckpt", "out"]) == 2
    assert "not available" in capsys.readouterr().err
