"""Hugging Face weights (zeroray.hf), without Ray and without downloads: tiny GPT-2 and Llama
models built from configs in code and saved into tmp_path.

- sliced loading: every rank's pieces at 2 and 3 workers tile each tensor and equal the
  saved values exactly, from one file and from a split (indexed) save; tied names, base
  model prefix, clear errors for a missing name and a changed shape;
- from_pretrained in model_fn (the engine's fallback) is deterministic and exact;
- export: from_pretrained loads back exactly what was exported (single and split, a state
  dict or a stream, fp32 or bf16), tied weights once, and ``zeroray export-hf`` from a real
  zeroray checkpoint written with the checkpoint package's own functions.
"""
import json
import os
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")

import safetensors.torch  # noqa: E402

from tests.real_models import gpt2_config, llama_config  # noqa: E402
from zeroray import cli  # noqa: E402
from zeroray.layout.arena import FlatLayout  # noqa: E402
from zeroray.checkpoint import CheckpointError, commit, write_extra, write_shard  # noqa: E402
from zeroray.hf import (INDEX_NAME, SINGLE_NAME, export_checkpoint, export_pretrained,  # noqa: E402
                        pretrained)

transformers.logging.set_verbosity_error()
GPT2 = transformers.GPT2LMHeadModel
LLAMA = transformers.LlamaForCausalLM
CONFIGS = {"gpt2": (GPT2, gpt2_config), "llama": (LLAMA, llama_config)}


def build(kind, seed=0):
    cls, config = CONFIGS[kind]
    torch.manual_seed(seed)
    return cls(config())


def saved(tmp_path, kind, split, seed=0):
    """(model, directory) with the model saved by save_pretrained, split into several files or not."""
    model = build(kind, seed)
    path = tmp_path / f"{kind}-{'split' if split else 'single'}"
    model.save_pretrained(path, max_shard_size="20KB" if split else "50GB")
    assert (path / INDEX_NAME).exists() == split and (path / SINGLE_NAME).exists() != split
    return model, path


def meta_layout(model_fn, world_size):
    with torch.device("meta"):
        return FlatLayout.from_module(model_fn(), world_size)


def rank_ranges(layout, rank):
    """{name: (lo, hi)}: what rank owns of each trainable parameter, as the engine computes it."""
    shard = torch.empty(layout.shard_numel, device="meta")
    out = {}
    for name in layout.param_names:
        _, lo, hi = layout.param_shard_view(shard, name, rank)
        out[name] = (lo, hi)
    return out


def assert_same_weights(model, reference):
    got, want = model.state_dict(), reference.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


# --- sliced loading --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_pieces_tile_each_tensor_and_equal_the_saved_values(tmp_path, kind, split, world_size):
    model, path = saved(tmp_path, kind, split)
    model_fn = pretrained(path)
    layout = meta_layout(model_fn, world_size)
    saved_values = dict(model.named_parameters())
    pieces = {name: [] for name in layout.param_names}
    for rank in range(world_size):
        wanted = rank_ranges(layout, rank)
        got = model_fn.read_pieces(wanted)
        assert set(got) == set(wanted)
        for name, (lo, hi) in wanted.items():
            assert got[name].dtype == torch.float32 and got[name].shape == (hi - lo,)
            pieces[name].append((lo, hi, got[name]))
    for name, parts in pieces.items():
        full = saved_values[name].detach().reshape(-1)
        covered = 0
        for lo, hi, t in sorted(parts, key=lambda p: p[0]):
            assert lo == covered or hi == lo, name  # consecutive, no gap, no overlap
            covered = max(covered, hi)
            assert torch.equal(t, full[lo:hi]), name
        assert covered == full.numel(), name


def test_pieces_read_into_the_rank_shard(tmp_path):
    model, path = saved(tmp_path, "gpt2", split=True)
    model_fn = pretrained(path)
    layout = meta_layout(model_fn, 3)
    params = dict(model.named_parameters())
    for rank in range(3):
        shard = torch.full((layout.shard_numel,), float("nan"))
        out, expected = {}, torch.zeros(layout.shard_numel)
        for name in layout.param_names:
            view, lo, hi = layout.param_shard_view(shard, name, rank)
            out[name] = view
            layout.param_shard_view(expected, name, rank)[0].copy_(params[name].detach().reshape(-1)[lo:hi])
        got = model_fn.read_pieces(rank_ranges(layout, rank), out=out)
        assert all(got[n] is out[n] for n in out)
        filled = torch.zeros(layout.shard_numel, dtype=torch.bool)
        for name in layout.param_names:
            view, _, _ = layout.param_shard_view(filled, name, rank)
            view.fill_(True)
        assert torch.equal(shard[filled], expected[filled])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_built_model_plus_pieces_and_whole_equals_from_pretrained(tmp_path, kind):
    model, path = saved(tmp_path, kind, split=False)
    model_fn = pretrained(path)
    torch.manual_seed(7)
    built = model_fn()
    assert all(p.dtype == torch.float32 for p in built.parameters())
    names = list(built.state_dict())
    trainable = {n for n, p in built.named_parameters()}
    wanted = {n: (0, built.state_dict()[n].numel()) for n in names if n in trainable}
    pieces = model_fn.read_pieces(wanted)
    whole = model_fn.read_whole([n for n in names if n not in trainable])
    with torch.no_grad():
        for n, t in built.state_dict().items():
            if n in pieces:
                t.copy_(pieces[n].reshape(t.shape))
            elif n in whole:
                t.copy_(whole[n])
    assert_same_weights(built, transformers.AutoModelForCausalLM.from_pretrained(path))


def test_saved_in_bf16_is_read_as_fp32(tmp_path):
    model = build("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    model_fn = pretrained(tmp_path)
    assert all(p.dtype == torch.float32 for p in model_fn().parameters())  # the saved config says bf16
    w = model.model.layers[0].mlp.up_proj.weight
    got = model_fn.read_pieces({"model.layers.0.mlp.up_proj.weight": (5, 70)})
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight"], w.detach().reshape(-1)[5:70].float())


def test_tied_weight_found_under_its_saved_name(tmp_path):
    model, path = saved(tmp_path, "gpt2", split=True)
    weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
    assert "lm_head.weight" not in weight_map and "transformer.wte.weight" in weight_map
    model_fn = pretrained(path)
    wte = model.transformer.wte.weight.detach().reshape(-1)
    n = wte.numel()
    # The model's own tie is found without help; an explicit alias works too.
    assert torch.equal(model_fn.read_pieces({"lm_head.weight": (3, n)})["lm_head.weight"], wte[3:])
    got = model_fn.read_pieces({"lm_head.weight": (0, 9)}, aliases={"lm_head.weight": ["transformer.wte.weight"]})
    assert torch.equal(got["lm_head.weight"], wte[:9])


def test_base_model_checkpoint_is_read_under_the_head_model_names(tmp_path):
    torch.manual_seed(0)
    base = transformers.GPT2Model(gpt2_config())  # files say "h.0...", GPT2LMHeadModel "transformer.h.0..."
    base.save_pretrained(tmp_path)
    model_fn = pretrained(tmp_path)
    w = base.h[1].mlp.c_fc.weight.detach().reshape(-1)
    got = model_fn.read_pieces({"transformer.h.1.mlp.c_fc.weight": (10, 50), "lm_head.weight": (0, 4)})
    assert torch.equal(got["transformer.h.1.mlp.c_fc.weight"], w[10:50])
    assert torch.equal(got["lm_head.weight"], base.wte.weight.detach().reshape(-1)[:4])


def test_missing_name_is_a_clear_error(tmp_path):
    model, path = saved(tmp_path, "llama", split=False)
    sd = {k: v for k, v in model.state_dict().items() if k != "model.layers.1.mlp.down_proj.weight"}
    safetensors.torch.save_file(sd, str(path / SINGLE_NAME), metadata={"format": "pt"})
    model_fn = pretrained(path)
    with pytest.raises(CheckpointError) as e:
        model_fn.read_pieces({"model.layers.1.mlp.down_proj.weight": (0, 8), "model.norm.weight": (0, 8)})
    msg = str(e.value)
    assert "'model.layers.1.mlp.down_proj.weight'" in msg and "model.norm.weight" not in msg
    assert SINGLE_NAME in msg and "from_pretrained" in msg and "model_class" in msg
    # read_whole leaves it out instead: the model keeps its built value, as from_pretrained does.
    assert set(model_fn.read_whole(["model.layers.1.mlp.down_proj.weight", "model.norm.weight"])) == {
        "model.norm.weight"}


def test_changed_shape_and_bad_range_are_errors(tmp_path):
    _, path = saved(tmp_path, "gpt2", split=False)
    with pytest.raises(CheckpointError, match=r"shape \[64, 32\].*shape \[64, 64\].*n_embd"):
        pretrained(path, n_embd=64).read_pieces({"transformer.wte.weight": (0, 4)})
    with pytest.raises(ValueError, match="outside its 2048 elements"):
        pretrained(path).read_pieces({"transformer.wte.weight": (0, 2049)})
    with pytest.raises(ValueError, match="not a directory"):
        pretrained(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        pretrained(tmp_path / "empty").read_pieces({"x": (0, 1)})


def test_pretrained_model_fn_pickles_without_its_cache(tmp_path):
    import cloudpickle

    _, path = saved(tmp_path, "gpt2", split=False)
    model_fn = pretrained(path, resid_pdrop=0.1)
    model_fn.read_pieces({"transformer.wpe.weight": (0, 3)})  # fills the cache
    for copy in (pickle.loads(pickle.dumps(model_fn)), cloudpickle.loads(cloudpickle.dumps(model_fn))):
        assert copy._info is None and copy.config().resid_pdrop == 0.1
        assert torch.equal(copy.read_pieces({"transformer.wpe.weight": (0, 3)})["transformer.wpe.weight"],
                           model_fn.read_pieces({"transformer.wpe.weight": (0, 3)})["transformer.wpe.weight"])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("split", [False, True])
def test_from_pretrained_in_model_fn_is_deterministic_and_exact(tmp_path, kind, split):
    model, path = saved(tmp_path, kind, split)
    model_fn = lambda: transformers.AutoModelForCausalLM.from_pretrained(path)  # noqa: E731
    torch.manual_seed(1)
    first = model_fn()
    torch.manual_seed(2)
    second = model_fn()
    assert_same_weights(first, model)
    assert_same_weights(second, model)


# --- export ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("max_shard_bytes", [2**30, 20_000])
def test_export_loads_back_exactly(tmp_path, kind, max_shard_bytes):
    model = build(kind)
    out = tmp_path / "out"
    written = export_pretrained(model.state_dict(), out, config=model.config, max_shard_bytes=max_shard_bytes)
    split = max_shard_bytes < 2**30
    assert (out / INDEX_NAME).exists() == split and (out / SINGLE_NAME).exists() != split
    assert str(out / "config.json") == written[-1]
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    if split:
        assert len(files) > 2 and all(os.path.getsize(out / f) < max_shard_bytes + 4096 for f in files)
        index = json.loads((out / INDEX_NAME).read_text())
        assert sorted(set(index["weight_map"].values())) == files
    assert_same_weights(transformers.AutoModelForCausalLM.from_pretrained(out), model)


def test_export_writes_tied_weights_once_and_takes_either_name(tmp_path):
    model = build("gpt2")
    sd = {k: v.clone() for k, v in model.state_dict().items() if k != "transformer.wte.weight"}
    export_pretrained(sd, tmp_path, config=model.config)  # only the alias of the tied pair is given
    with safetensors.safe_open(str(tmp_path / SINGLE_NAME), "pt") as f:
        keys = set(f.keys())
        assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys and f.metadata()["format"] == "pt"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_same_weights(loaded, model)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_export_from_a_stream_in_bf16(tmp_path):
    model = build("llama")
    consumed = []

    def stream():
        for name, t in model.state_dict().items():
            consumed.append(name)
            yield name, t

    export_pretrained(stream(), tmp_path, config=model.config, dtype="bf16", max_shard_bytes=30_000)
    assert consumed == list(model.state_dict())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for k, v in model.state_dict().items():
        assert loaded.state_dict()[k].dtype == torch.bfloat16 and torch.equal(loaded.state_dict()[k], v.bfloat16()), k


def test_export_rejects_tensors_that_do_not_fit_the_config(tmp_path):
    model = build("gpt2")
    sd = model.state_dict()
    with pytest.raises(ValueError, match="'extra.weight': not a tensor of GPT2LMHeadModel"):
        export_pretrained({**sd, "extra.weight": torch.zeros(2)}, tmp_path / "a", config=model.config)
    with pytest.raises(ValueError, match="no tensor for 'transformer.ln_f.bias'.*at random"):
        export_pretrained({k: v for k, v in sd.items() if k != "transformer.ln_f.bias"}, tmp_path / "b",
                          config=model.config)
    with pytest.raises(ValueError, match="'transformer.wpe.weight' has shape"):
        export_pretrained({**sd, "transformer.wpe.weight": torch.zeros(3, 32)}, tmp_path / "c",
                          config=model.config)
    # A stream finds the problem late: the files written so far are deleted, no config.json.
    with pytest.raises(ValueError, match="no tensor for"):
        export_pretrained(iter(list(sd.items())[:-3]), tmp_path / "d", config=model.config, max_shard_bytes=20_000)
    assert os.listdir(tmp_path / "d") == []
    with pytest.raises(ValueError, match="model_type"):
        export_pretrained(sd, tmp_path / "e", config={"n_embd": 32})


def test_export_into_an_earlier_export_replaces_its_files(tmp_path):
    model = build("gpt2", seed=3)
    export_pretrained(build("gpt2").state_dict(), tmp_path, config=model.config, max_shard_bytes=20_000)
    export_pretrained(model.state_dict(), tmp_path, config=model.config)
    assert sorted(os.listdir(tmp_path)) == ["config.json", SINGLE_NAME]
    assert_same_weights(transformers.AutoModelForCausalLM.from_pretrained(tmp_path), model)


def write_zeroray_checkpoint(root, model, world_size, step=4):
    """A zeroray sharded checkpoint of ``model``, written as the workers and driver write one."""
    layout = FlatLayout.from_module(model, world_size)
    params = dict(model.named_parameters())
    infos = []
    for rank in range(world_size):
        master = torch.zeros(layout.shard_numel)
        for name in layout.param_names:
            view, lo, hi = layout.param_shard_view(master, name, rank)
            view.copy_(params[name].detach().reshape(-1)[lo:hi])
        infos.append(write_shard(root, step, rank, {"master": master}, {"step": step}))
    tied = set(layout.slots)
    extra = {k: v for k, v in model.state_dict().items() if k not in tied}
    if extra:
        infos.append(write_extra(root, step, extra))
    commit(root, step, {"layout": layout, "config": {}}, infos)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_cli_export_hf_from_a_zeroray_checkpoint(tmp_path, kind, capsys):
    model = build(kind)
    if kind == "llama":  # a frozen parameter: saved in the checkpoint's extra file, not sharded
        model.model.embed_tokens.weight.requires_grad_(False)
    write_zeroray_checkpoint(tmp_path / "ckpt", model, 3)
    model.config.save_pretrained(tmp_path / "cfg")
    out = tmp_path / "hf"
    rc = cli.main(["export-hf", str(tmp_path / "ckpt"), str(out), "--config", str(tmp_path / "cfg" / "config.json"),
                   "--max-shard-size", "30KB"])
    assert rc == 0, capsys.readouterr().err
    assert "from_pretrained" in capsys.readouterr().out
    assert (out / INDEX_NAME).exists()
    assert_same_weights(transformers.AutoModelForCausalLM.from_pretrained(out), model)


def test_export_checkpoint_in_fp16_and_cli_errors(tmp_path, capsys):
    model = build("gpt2")
    write_zeroray_checkpoint(tmp_path / "ckpt", model, 2)
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", config=model.config, dtype=torch.float16)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v.half()), k

    assert cli.main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "x"), "--config", str(tmp_path)]) == 2
    assert "config.json does not exist" in capsys.readouterr().err
    llama = tmp_path / "llama"
    build("llama").config.save_pretrained(llama)
    assert cli.main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "x"), "--config", str(llama)]) == 2
    assert "not a tensor of LlamaForCausalLM" in capsys.readouterr().err
    assert cli.main(["export-hf", str(tmp_path / "nothing"), str(tmp_path / "x"), "--config", str(llama)]) == 1
    assert cli.main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "x"), "--config", str(llama),
                     "--max-shard-size", "5XB"]) == 2
    assert "is not a size" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() or not os.listdir(tmp_path / "x")


def test_a_model_class_that_cannot_be_built_on_meta_still_reads_by_exact_name(tmp_path, caplog):
    model, path = saved(tmp_path, "gpt2", split=False)

    def on_cpu_only(config):
        if torch.empty(0).device.type == "meta":
            raise RuntimeError("needs real memory")
        return GPT2(config)

    model_fn = pretrained(path, model_class=on_cpu_only)
    assert isinstance(model_fn(), GPT2)
    got = model_fn.read_pieces({"transformer.h.0.ln_1.weight": (0, 32)})
    assert torch.equal(got["transformer.h.0.ln_1.weight"], model.transformer.h[0].ln_1.weight.detach())
    assert "cannot build the model on the meta device" in caplog.text
    with pytest.raises(CheckpointError, match="'lm_head.weight'"):  # no tie known: exact names only
        model_fn.read_pieces({"lm_head.weight": (0, 4)})


def test_read_flat_into_converts_and_fills_strided_targets(tmp_path):
    from zeroray.checkpoint.filesystem import LocalStorage
    from zeroray.checkpoint.tensorfile import TensorFileReader

    values = torch.randn(5, 7)
    safetensors.torch.save_file({"w": values, "h": values.half()}, str(tmp_path / "f.safetensors"))
    reader = TensorFileReader(LocalStorage().open_range(str(tmp_path / "f.safetensors")))
    flat = values.reshape(-1)
    into = torch.zeros(10)
    assert reader.read_flat_into("w", 3, into) is into and torch.equal(into, flat[3:13])
    strided = torch.zeros(30)[::2]  # not contiguous: goes through the buffer
    reader.read_flat_into("w", 20, strided[:15])
    assert torch.equal(strided[:15], flat[20:35])
    as_bf16 = torch.zeros(4, dtype=torch.bfloat16)
    assert torch.equal(reader.read_flat_into("h", 1, as_bf16), flat.half()[1:5].bfloat16())
    with pytest.raises(ValueError, match=r"cannot read elements \[30, 40\)"):
        reader.read_flat_into("w", 30, torch.zeros(10))
    reader.file.close()
