"""Issue 24: mixed precision runs a model as ``model.to(dtype)`` would, with an fp32 master, and
keeps in fp32 what PyTorch's and Hugging Face's recipes keep there ([Note: mixed precision] in
zeroray/engine/precision.py). Each model trains a few AdamW steps at stages 0-3 under bf16 and fp16 and
stays within 3% (relative loss, every step) of the same run in fp32; the buffers inside the
engine have the rule's dtypes, and running statistics are updated as in fp32.

The fp32 runs are one per model (stage 0): fp32 runs are equal to single-process PyTorch at
every stage (tests/dist/test_engine_parity.py). All runs share one set of processes.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroray as zr
from tests.dist.harness import run_engines
from tests.real_models import hf_llama, real_batches, real_loss

STEPS, VOCAB, WIDTH, SEQ, CLASSES = 4, 32, 16, 8, 4
TOLERANCE = 0.03
STAGES = (0, 1, 2, 3)
LOW = ("bf16", "fp16")


class ScaleNet(nn.Module):
    """``emb(x) * scale`` with the scale an fp32 buffer (a per-feature one: it takes part in type
    promotion, unlike a 0-dim tensor), then a Linear: the issue's first failing model."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("scale", torch.full((WIDTH,), math.sqrt(WIDTH)))

    def forward(self, idx):
        return self.out(self.emb(idx) * self.scale)


class SinusoidNet(nn.Module):
    """A sinusoidal position table registered as a buffer, added to the embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)
        pos = torch.arange(SEQ, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, WIDTH, 2, dtype=torch.float32) * (-math.log(1e4) / WIDTH))
        self.register_buffer("pe", torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=-1))

    def forward(self, idx):
        h = self.emb(idx) + self.pe[:idx.shape[1]]
        return self.out(torch.tanh(self.mix(h)))


class BatchNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)
        self.fc2 = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        x = x.to(self.fc1.weight.dtype)  # the input in the compute dtype, as for model.to(dtype)
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class BatchNormCNN(nn.Module):
    """Conv-BatchNorm2d blocks in an nn.Sequential (each block a unit, and a checkpoint target
    under activation_checkpointing=True), pooled into a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(ConvBlock(3, 8), ConvBlock(8, 8))
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        x = x.to(self.head.weight.dtype)
        return self.head(self.blocks(x).mean(dim=(2, 3)))


class KeptHead(nn.Module):
    """A module kept in fp32 by the model's ``_keep_in_fp32_modules_strict``: it checks that it
    computes in fp32 (inputs, its own and its children's parameters, its frozen parameter and
    buffer), and its children are units of their own (gathered when first read, stage 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(WIDTH))
        self.layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB))
        self.offset = nn.Parameter(torch.full((VOCAB,), 0.1), requires_grad=False)
        self.register_buffer("temperature", torch.tensor([1.5]))

    def forward(self, h):
        seen = [h.dtype, self.gain.dtype, self.offset.dtype, self.temperature.dtype,
                self.layers[0].weight.dtype, self.layers[2].bias.dtype]
        if any(d != torch.float32 for d in seen):
            raise TypeError(f"KeptHead computes in {seen}, expected fp32 throughout")
        return self.layers(h * self.gain) / self.temperature + self.offset


class KeptNet(nn.Module):
    _keep_in_fp32_modules_strict = ["head"]  # as a Hugging Face model declares it

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.frozen_bias = nn.Parameter(torch.zeros(WIDTH), requires_grad=False)
        self.register_buffer("shift", torch.full((WIDTH,), 0.01))
        self.head = KeptHead()

    def forward(self, idx):
        h = self.emb(idx) + self.frozen_bias + self.shift
        if h.dtype != self.emb.weight.dtype:
            raise TypeError(f"outside the kept head the model computes in {h.dtype}")
        out = self.head(h)
        if out.dtype != torch.float32:  # as from_pretrained(dtype=...) runs a kept module
            raise TypeError(f"the kept head returned {out.dtype}, expected its fp32 output as computed")
        return out


def class_loss(model, batch):
    x, y = batch
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def token_batches(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (8, SEQ), generator=g), torch.randint(0, VOCAB, (8, SEQ), generator=g))
            for _ in range(STEPS)]


def feature_batches(seed: int, shape):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, *shape, generator=g), torch.randint(0, CLASSES, (16,), generator=g))
            for _ in range(STEPS)]


# name -> (model_fn, loss_fn, batches, extra ZeroConfig fields). The checkpointed ones recompute
# an fp32 module in backward (a BatchNorm inside a checkpointed block; checkpointed blocks inside
# the kept head: [Note: fp32 regions] in zeroray/engine/precision.py), at stage 3 only, where the
# recomputation also gathers.
MODELS = {
    "scale": (ScaleNet, class_loss, token_batches(1), {}),
    "sinusoid": (SinusoidNet, class_loss, token_batches(2), {}),
    "bn1d-mlp": (BatchNormMLP, class_loss, feature_batches(3, (8,)), {}),
    "bn2d-cnn": (BatchNormCNN, class_loss, feature_batches(4, (3, 6, 6)), {}),
    "bn2d-cnn-checkpointed": (BatchNormCNN, class_loss, feature_batches(4, (3, 6, 6)),
                              {"activation_checkpointing": True}),
    "hf-keep-fp32": (KeptNet, class_loss, token_batches(5), {}),
    "hf-keep-fp32-checkpointed": (KeptNet, class_loss, token_batches(5), {"activation_checkpointing": True}),
    "hf-llama": (hf_llama, real_loss, real_batches(STEPS, batch=4), {}),
}
CHECKPOINTED_STAGES = (3,)


def stages_of(model):
    return CHECKPOINTED_STAGES if model.endswith("-checkpointed") else STAGES


# Buffers (engine names) and the dtype each must have under bf16/fp16 ("low": the compute dtype).
EXPECTED_BUFFERS = {
    "scale": {"scale": "low"},
    "sinusoid": {"pe": "low"},
    "bn1d-mlp": {"bn.running_mean": torch.float32, "bn.running_var": torch.float32,
                 "bn.num_batches_tracked": torch.int64},
    "bn2d-cnn": {f"blocks.{i}.bn.{b}": torch.float32 for i in (0, 1) for b in ("running_mean", "running_var")},
    "hf-keep-fp32": {"shift": "low", "head.temperature": torch.float32},
    "hf-llama": {"model.rotary_emb.inv_freq": torch.float32, "model.rotary_emb.original_inv_freq": torch.float32},
}
EXPECTED_BUFFERS["bn2d-cnn-checkpointed"] = EXPECTED_BUFFERS["bn2d-cnn"]
EXPECTED_BUFFERS["hf-keep-fp32-checkpointed"] = EXPECTED_BUFFERS["hf-keep-fp32"]
RUNNING_STATS = {"bn1d-mlp": ["bn.running_mean", "bn.running_var"],
                 "bn2d-cnn": [f"blocks.{i}.bn.running_mean" for i in (0, 1)],
                 "bn2d-cnn-checkpointed": [f"blocks.{i}.bn.running_mean" for i in (0, 1)]}


def spec(model, stage, dtype):
    model_fn, loss_fn, batches, extra = MODELS[model]
    scale = {"initial_loss_scale": 2.0**10} if dtype == "fp16" else {}
    return dict(model_fn=model_fn, loss_fn=loss_fn, batches=batches, optimizer=zr.AdamW(lr=1e-2),
                zero=zr.ZeroConfig(stage=stage, dtype=dtype, **extra, **scale))


@pytest.fixture(scope="module")
def runs():
    keys = [(m, 0, "fp32") for m in MODELS] + [(m, s, d) for m in MODELS for s in stages_of(m) for d in LOW]
    out = run_engines(2, [spec(*k) for k in keys])
    return {k: results for k, (results, _) in zip(keys, out)}


def initial_buffers(model):
    torch.manual_seed(0)
    return dict(MODELS[model][0]().named_buffers())


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("stage", STAGES)
def test_low_precision_trains_as_fp32_with_fp32_norms(runs, stage, dtype):
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    worst, stats = {}, {}
    for model in (m for m in MODELS if stage in stages_of(m)):
        ref, low = runs[(model, 0, "fp32")][0], runs[(model, stage, dtype)][0]
        assert not any(low["skipped"]), f"{model}: an fp16 step was skipped: {low['skipped']}"
        rel = [abs(a - b) / abs(a) for a, b in zip(low["losses"], ref["losses"])]
        worst[model] = max(rel)
        assert max(rel) < TOLERANCE, f"{model} stage {stage} {dtype}: losses {low['losses']} vs fp32 {ref['losses']}"
        for name, want in EXPECTED_BUFFERS.get(model, {}).items():
            want = compute if want == "low" else want
            assert low["buffer_dtypes"][name] == want, f"{model}: buffer {name} is {low['buffer_dtypes'][name]}"
        # Exported state is in the model's own dtypes: it loads strict into the fp32 model.
        for name, value in low["untrained"].items():
            assert value.dtype == ref["untrained"][name].dtype, f"{model}: {name} exported as {value.dtype}"
        init = initial_buffers(model)
        for name in RUNNING_STATS.get(model, []):
            got, fp32 = low["untrained"][name], ref["untrained"][name]
            assert not torch.equal(got, init[name]), f"{model}: {name} was never updated"
            assert torch.allclose(got, fp32, rtol=0.05, atol=0.02), \
                f"{model}: {name} {got} vs fp32 {fp32} (max diff {(got - fp32).abs().max():.3g})"
            stats[model] = max(stats.get(model, 0.0), (got - fp32).abs().max().item())
    print(f"stage {stage} {dtype}: worst relative loss difference per model "
          + ", ".join(f"{m} {v:.2e}" for m, v in worst.items())
          + "; running statistics, max abs difference from fp32: "
          + ", ".join(f"{m} {v:.2e}" for m, v in stats.items()))


@pytest.mark.parametrize("dtype", LOW)
def test_frozen_parameters_take_the_compute_dtype_outside_fp32_modules(runs, dtype):
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    for stage in STAGES:
        frozen = runs[("hf-keep-fp32", stage, dtype)][0]["frozen_dtypes"]
        assert frozen == {"frozen_bias": compute, "head.offset": torch.float32}, f"stage {stage}: {frozen}"
