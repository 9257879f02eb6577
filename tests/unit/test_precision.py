"""The mixed-precision rule of zeroray/engine/precision.py in one process: which modules compute in
fp32 (transformers' own matching is the oracle for the Hugging Face part), which tensors are
cast under each ``cast_buffers``, the fp32 forward against the same module in fp32, and the
engine's exported and restored state in the model's own dtypes."""
import pytest
import torch
import torch.nn as nn

import zeroray as zr
from zeroray.comm.group import SoloGroup
from zeroray.engine.engine import Engine
from zeroray.engine.precision import MixedPrecision, fp32_modules, hf_fp32_module_names


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.rand(4), persistent=False)
        self.register_buffer("original_inv_freq", torch.rand(4), persistent=False)


class Zoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.rotary = Rotary()
        self.bn = nn.BatchNorm1d(4)
        self.bn_frozen = nn.BatchNorm1d(4)
        self.bn_frozen.weight.requires_grad_(False)
        self.bn_no_stats = nn.BatchNorm1d(4, track_running_stats=False)
        self.inorm = nn.InstanceNorm1d(4)
        self.inorm_stats = nn.InstanceNorm1d(4, affine=True, track_running_stats=True)
        self.sync = nn.SyncBatchNorm(4)
        self.ln = nn.LayerNorm(4)
        self.block = nn.Sequential(nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1))


def test_fp32_modules_are_the_norms_with_running_statistics():
    model = Zoo()
    assert fp32_modules(model, torch.float32) == []
    names = [n for n, _ in fp32_modules(model, torch.bfloat16)]
    assert names == ["bn", "bn_frozen", "inorm_stats", "sync", "block.0"]


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4))
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


class Outer(nn.Module):
    _keep_in_fp32_modules_strict = ["router"]  # under bf16 and fp16
    _keep_in_fp32_modules = ["rest"]  # under fp16 only

    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.rest = nn.Linear(4, 4)


def test_hugging_face_patterns_and_nesting():
    # "router" matches router.bias (owner: router) and router.layers.0.weight (owner: router.layers.0)...
    assert hf_fp32_module_names(Outer(), torch.bfloat16) == {"router", "router.layers.0", "router.layers.1"}
    assert hf_fp32_module_names(Outer(), torch.float16) == {"router", "router.layers.0", "router.layers.1", "rest"}
    # ...and only the outermost is wrapped: its wrapper reads its descendants' parameters as fp32 too.
    assert [n for n, _ in fp32_modules(Outer(), torch.bfloat16)] == ["router"]
    assert [n for n, _ in fp32_modules(Outer(), torch.float16)] == ["router", "rest"]


def _tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                               num_decoder_layers=1, num_heads=2, decoder_start_token_id=0))


def _tiny_deepseek_v2():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    return DeepseekV2ForCausalLM(DeepseekV2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=4, max_position_embeddings=16))


@pytest.mark.parametrize("build", [_tiny_t5, _tiny_deepseek_v2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hugging_face_fp32_modules_match_transformers_own_rule(build, dtype):
    """transformers' dtype plan and its glob matching, grouped by owning module as its FSDP plan
    groups them (transformers/distributed/mixin.py), is the oracle."""
    pytest.importorskip("transformers")
    from transformers.core_model_loading import build_glob_alternation

    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = build()
    plan = model._get_dtype_plan(dtype)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    expected = set()
    if plan:
        kept, _, _ = build_glob_alternation(list(plan))
        expected = {n.rpartition(".")[0] for n in names if kept.search(n)}
    assert hf_fp32_module_names(model, dtype) == expected
    # T5 keeps "wo" under fp16 only; DeepSeek-V2 keeps its routers' gate under both.
    assert bool(expected) == (build is _tiny_deepseek_v2 or dtype == torch.float16)


@pytest.mark.parametrize("cast_buffers, scale, inv_freq", [
    (None, torch.bfloat16, torch.float32), (True, torch.bfloat16, torch.bfloat16),
    (False, torch.float32, torch.float32)])
def test_which_tensors_take_the_compute_dtype(cast_buffers, scale, inv_freq):
    model = Zoo()
    model.rotary.register_buffer("shared", model.scale)
    MixedPrecision(model, torch.bfloat16, cast_buffers).cast()
    assert model.scale.dtype == scale
    assert model.rotary.shared is model.scale  # still one tensor
    assert model.rotary.inv_freq.dtype == model.rotary.original_inv_freq.dtype == inv_freq
    assert model.steps.dtype == torch.long
    assert model.frozen.weight.dtype == torch.bfloat16  # frozen outside fp32 modules: compute dtype
    assert model.lin.weight.dtype == torch.float32  # trainable ones are the units' business
    for bn in (model.bn, model.bn_frozen, model.sync, model.inorm_stats, model.block[0]):
        assert bn.running_mean.dtype == bn.running_var.dtype == torch.float32
    assert model.bn_frozen.weight.dtype == torch.float32  # frozen inside an fp32 module: fp32
    MixedPrecision(fp32 := Zoo(), torch.float32, True).cast()
    assert fp32.scale.dtype == fp32.frozen.weight.dtype == torch.float32


class TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x, *, extra):
        y = self.bn(x)
        return y, {"twice": 2 * y, "n": 3, "ids": torch.arange(2), "extra": extra}


def test_the_fp32_forward_matches_the_module_in_fp32_and_grads_reach_the_compute_copy():
    torch.manual_seed(0)
    ref = TupleOut()
    low = TupleOut()
    low.load_state_dict(ref.state_dict())
    low.bn.weight.data = low.bn.weight.data.bfloat16()  # what a unit's compute-dtype buffer holds
    low.bn.bias.data = low.bn.bias.data.bfloat16()
    precision = MixedPrecision(low, torch.bfloat16, None)
    precision.cast()
    restore = precision.wrap()
    x = torch.randn(6, 4)
    want, want_d = ref(x.bfloat16().float(), extra=x)
    got, got_d = low(x.bfloat16(), extra=x.bfloat16())
    assert got.dtype == got_d["twice"].dtype == got_d["extra"].dtype == torch.bfloat16
    assert got_d["n"] == 3 and got_d["ids"].dtype == torch.long
    assert torch.allclose(got.float(), want, atol=1e-2, rtol=1e-2)
    assert torch.allclose(low.bn.running_mean, ref.bn.running_mean) and low.bn.running_mean.dtype == torch.float32
    assert isinstance(low.bn.weight, nn.Parameter)  # put back after the call
    got.float().sum().backward()
    assert low.bn.weight.grad.dtype == torch.bfloat16
    want.sum().backward()
    assert torch.allclose(low.bn.weight.grad.float(), ref.bn.weight.grad, atol=1e-2, rtol=1e-2)
    restore()
    assert "forward" not in low.bn.__dict__


def test_a_model_output_comes_back_in_the_input_dtype():
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import BaseModelOutput

    class Out(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return BaseModelOutput(last_hidden_state=self.bn(x), hidden_states=(x, x))

    model = Out()
    for p in model.bn.parameters():
        p.data = p.data.bfloat16()
    precision = MixedPrecision(model, torch.bfloat16, None)
    precision.wrap()
    out = model(torch.randn(3, 4, dtype=torch.bfloat16))
    assert isinstance(out, BaseModelOutput)
    assert out.last_hidden_state.dtype == out[0].dtype == out.hidden_states[1].dtype == torch.bfloat16


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.full((4,), 0.3))
        self.register_buffer("rope_inv_freq_like", torch.full((4,), 0.1))
        self.frozen = nn.Parameter(torch.full((4,), 0.7), requires_grad=False)

    def forward(self, x):
        return self.bn(self.fc(x.to(self.fc.weight.dtype)) * self.scale + self.frozen)


def bn_loss(model, batch):
    return model(batch).float().pow(2).mean()


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_state_is_exported_in_the_models_dtypes_and_restored_into_the_engines(stage):
    """untrained_state loads strict=True into the fp32 model with its dtypes; import_untrained
    (a checkpoint's extra tensors) casts back into the engine's; close puts the forwards back."""
    zero = zr.ZeroConfig(stage=stage, dtype="bf16")
    engine = Engine(BNNet, bn_loss, zr.AdamW(lr=1e-2), zero, SoloGroup())
    engine.train_step(torch.randn(8, 4))
    state = engine.untrained_state()
    user = BNNet()
    assert {k: v.dtype for k, v in state.items()} == {k: v.dtype for k, v in user.state_dict().items()
                                                      if k not in ("fc.weight", "fc.bias", "bn.weight", "bn.bias")}
    user.load_state_dict({**user.state_dict(), **state}, strict=True)
    assert int(state["bn.num_batches_tracked"]) == 1

    fresh = Engine(BNNet, bn_loss, zr.AdamW(lr=1e-2), zero, SoloGroup())
    assert fresh.import_untrained(state) == []
    assert fresh.model.scale.dtype == fresh.model.frozen.dtype == torch.bfloat16
    assert fresh.model.bn.running_mean.dtype == torch.float32
    for name, value in fresh.untrained_state().items():
        assert torch.equal(value, state[name]), name
    assert sorted(fresh.import_untrained({})) == sorted(state)
    for e in (engine, fresh):
        e.close()
        assert "forward" not in e.model.bn.__dict__
