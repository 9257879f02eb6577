"""End to end: the README's fine-tuning commands (examples/make_tiny_hf.py, examples/finetune_hf.py),
run as written, on a model and text made on this machine (nothing downloaded).

- The README's commands, each a process of its own with its own local Ray, in a scratch directory:
  the tiny model and text are made; a full fine-tune at stage 3 in bf16 stops after step 40 at 2
  workers and resumes at 3 to step 60, with perplexity falling, a sample and a checked export;
  a LoRA fine-tune exports the adapters merged into the base weights and checks that export.
- The resume against the oracle: the same job in fp32, stopped at 2 workers and resumed at 3,
  has the per-step losses and final weights of single-process PyTorch on the same padded batches
  (the per-token loss of [Note: the loss of a padded batch] in examples/hf_text.py makes the
  step independent of the number of workers).
- Bad input is an InputError that says what to do (the command line prints it as one line,
  without a traceback, before Ray starts).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))  # the examples import their siblings (hf_text) as the scripts do

import finetune_hf  # noqa: E402
import hf_text  # noqa: E402
import make_tiny_hf  # noqa: E402

from zeroray.checkpoint import full_state_dict, latest_checkpoint  # noqa: E402
from tests.readme_commands import ways_to_run, without_comment  # noqa: E402

pytestmark = pytest.mark.slow
COMMAND_TIMEOUT_S = 600
PERPLEXITY = re.compile(r"^step (\d+): .*perplexity ([\d.]+)$", re.M)


def readme_commands() -> list[str]:
    return [without_comment(c) for c in ways_to_run()["Fine-tuning a Hugging Face model"]]


def script_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("made") / "tiny"
    assert make_tiny_hf.main([str(out)]) == 0
    return out


@pytest.mark.timeout(1800)  # four processes, each starting Ray and its workers: minutes idle, far more under load
def test_readme_commands_run_as_written(tmp_path):
    commands = readme_commands()
    assert [c.split()[1] for c in commands] == ["examples/make_tiny_hf.py"] + ["examples/finetune_hf.py"] * 3
    (tmp_path / "examples").symlink_to(EXAMPLES)  # the commands' relative paths, with their output in tmp_path
    logs = []
    for command in commands:
        out = subprocess.run(shlex.split(command), cwd=tmp_path, env=script_env(), capture_output=True, text=True,
                             timeout=COMMAND_TIMEOUT_S)
        assert out.returncode == 0, f"{command}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        logs.append(out.stdout)
    made, stopped, resumed, lora = logs
    assert "LlamaForCausalLM" in made and (tmp_path / "tiny/model/tokenizer.json").is_file()

    assert "stopped at step 40 of 60" in stopped and "export" not in stopped
    assert "saved by 2 worker(s), continuing with 3" in resumed
    ppl = {int(s): float(p) for s, p in PERPLEXITY.findall(stopped + resumed)}
    assert sorted(ppl) == [0, 20, 40, 60], ppl
    assert ppl[0] > ppl[20] > ppl[40] > ppl[60], ppl  # the held-out perplexity falls
    for log, how in ((resumed, "zeroray export-hf"), (lora, "the LoRA adapters merged into the base weights")):
        assert re.search(r"^sample: '.+'$", log, re.M), log
        assert how in log and "export check: from_pretrained loads all" in log, log
    assert "(LoRA adapters)" in lora

    from transformers import AutoModelForCausalLM, AutoTokenizer

    for export in ("tiny/finetuned", "tiny/lora-merged"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / export)
        assert type(model).__name__ == "LlamaForCausalLM"  # a plain model: the adapters are merged
        assert AutoTokenizer.from_pretrained(tmp_path / export).pad_token == make_tiny_hf.PAD
    print("\n" + "\n".join(f"$ {c}\n{log.strip()}" for c, log in zip(commands, logs)))


def _losses(metrics: Path) -> dict:
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r}


def _oracle(tiny: Path, steps: int, batch_size: int, max_length: int, lr: float, eval_fraction: float):
    """Single-process PyTorch on the job's batches: its tokenizer, split, loss, AdamW and clipping."""
    from transformers import AutoModelForCausalLM

    tokenizer = finetune_hf.load_tokenizer(str(tiny / "model"))
    train, _ = hf_text.split(hf_text.read_texts(str(tiny / "text.jsonl")), eval_fraction, 0)
    rows = hf_text.tokenize(tokenizer, train, max_length)
    model = AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for batch in hf_text.Batches(rows, batch_size, steps, tokenizer.pad_token_id, seed=0):
        optimizer.zero_grad(set_to_none=True)
        loss = hf_text.loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_resume_at_another_worker_count_equals_single_process_pytorch(ray_local, tiny, tmp_path, capsys):
    steps, stop = 4, 2
    common = ["--model", str(tiny / "model"), "--data", str(tiny / "text.jsonl"), "--dtype", "fp32",
              "--steps", str(steps), "--eval-every", "2", "--checkpoint-dir", str(tmp_path / "ckpts"),
              "--checkpoint-every", "2", "--max-length", "32", "--eval-fraction", "0.02"]
    assert finetune_hf.main([*common, "--stop-after", str(stop), "--metrics", str(tmp_path / "run1.jsonl")]) == 0
    assert finetune_hf.main([*common, "--resume", "latest", "--num-workers", "3",
                             "--metrics", str(tmp_path / "run2.jsonl")]) == 0
    log = capsys.readouterr().out
    assert "saved by 2 worker(s), continuing with 3" in log
    losses = {**_losses(tmp_path / "run1.jsonl"), **_losses(tmp_path / "run2.jsonl")}
    assert sorted(losses) == list(range(1, steps + 1)), losses
    ref_losses, ref_state = _oracle(tiny, steps, 12, 32, 2e-3, 0.02)
    for step in range(1, steps + 1):
        assert losses[step] == pytest.approx(ref_losses[step - 1], rel=1e-5), (step, losses, ref_losses)
    got = full_state_dict(latest_checkpoint(str(tmp_path / "ckpts")))
    worst = max((got[k].float() - v).abs().max().item() for k, v in ref_state.items())
    assert worst <= 1e-5, worst
    print(f"\n  losses (2 workers to step {stop}, then 3): {[round(losses[s], 6) for s in sorted(losses)]}"
          f"\n  single-process PyTorch:                  {[round(x, 6) for x in ref_losses]}; max param diff {worst:.1e}")


def _bert_dir(path: Path) -> Path:
    """A masked LM (BertForMaskedLM), saved: a model that is not a causal LM."""
    from transformers import BertConfig, BertForMaskedLM

    BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32)).save_pretrained(path)
    return path


def _bad_inputs(tiny: Path, tmp: Path) -> dict:
    binary = tmp / "data.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    not_jsonl = tmp / "data.jsonl"
    not_jsonl.write_text('{"text": "fine"}\nthis line is not JSON\n')
    wrong_field = tmp / "other.jsonl"
    wrong_field.write_text('{"body": "text under another name"}\n')
    no_tokenizer = tmp / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((tiny / "model" / name).read_bytes())
    no_weights = tmp / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_bytes((tiny / "model" / "config.json").read_bytes())
    model, data = str(tiny / "model"), str(tiny / "text.jsonl")
    return {
        "missing model": ([str(tmp / "nowhere"), data], "is not a directory: give the directory that model.save_pretrained"),
        "no config": ([str(tmp), data], "holds no config.json"),
        "not a causal LM": ([str(_bert_dir(tmp / "bert")), data], "is a BertForMaskedLM model, not a causal language model"),
        "no tokenizer": ([str(no_tokenizer), data], "has no tokenizer that AutoTokenizer loads"),
        "no safetensors": ([str(no_weights), data], "holds no model.safetensors"),
        "missing data": ([model, str(tmp / "none.txt")], "no such file"),
        "binary data": ([model, str(binary)], "is not UTF-8 text"),
        "not JSONL": ([model, str(not_jsonl)], "is not JSONL: line 2 is not JSON"),
        "no text field": ([model, str(wrong_field)], "expected an object with a string field 'text', got keys ['body']"),
    }


def test_bad_input_is_a_clear_error(tiny, tmp_path):
    for case, ((model, data), message) in _bad_inputs(tiny, tmp_path).items():
        with pytest.raises(hf_text.InputError, match=re.escape(message)):
            finetune_hf.main(["--model", model, "--data", data])
    resumed_without_run = ["--model", str(tiny / "model"), "--data", str(tiny / "text.jsonl"),
                           "--checkpoint-dir", str(tmp_path / "empty"), "--resume"]
    with pytest.raises(hf_text.InputError, match="no checkpoint under"):
        finetune_hf.main(resumed_without_run)


def test_the_command_line_prints_input_errors_without_a_traceback(tiny, tmp_path):
    out = subprocess.run([sys.executable, str(EXAMPLES / "finetune_hf.py"), "--model", str(tiny / "model"),
                          "--data", str(tmp_path / "none.txt")], env=script_env(), capture_output=True, text=True,
                         timeout=COMMAND_TIMEOUT_S)
    assert out.returncode == 1
    assert out.stderr.startswith(f"error: {tmp_path / 'none.txt'}: no such file"), out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
