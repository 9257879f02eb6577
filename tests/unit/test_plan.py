"""The step simulator (zeroray.plan): its units against the real models, its costs against their
formulas, its memory against the paper's model, its stage-3 replay against the engine's Schedule,
and the stage choice of ``ZeroConfig(stage="auto")``. Pure arithmetic: no Ray, no collectives."""
import json

import pytest
import torch

from zeroray import plan
from zeroray.cli import main
from zeroray.fetch.trace import Schedule
from zeroray.layout.arena import FlatLayout
from zeroray.memory import model as memory
from zeroray.plan import replay
from zeroray.plan.costs import Ring, dp_ring
from tests.models import parity_model

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 101, "max_position_embeddings": 32}
TINY_GPT2 = {"model_type": "gpt2", "n_embd": 48, "n_layer": 2, "n_head": 4, "vocab_size": 97, "n_positions": 16}


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_GPT2], ids=["llama", "gpt2"])
def test_hf_config_units_count_the_real_model(config):
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "model_type"},
                                                   model_type=config["model_type"])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    w = plan.from_hf_config(config)
    assert w.params == memory.count_params(model)
    assert sum(u.attention for u in w.units) == w.layers


def test_module_units_are_the_engines_layout():
    w = plan.from_module(parity_model, seq_len=8)
    layout = FlatLayout.from_module(parity_model(), 1, wrap="auto")
    assert [u.params for u in w.units] == [u.numel for u in layout.units]
    assert w.params == memory.count_params(parity_model, trainable_only=True)
    assert all(u.matmul_params <= u.params for u in w.units)


def test_module_blocks_with_multihead_attention_count_attention_once():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(16)
            self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)

    def net():
        m = torch.nn.Module()
        m.emb = torch.nn.Embedding(11, 16)
        m.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        return m

    w = plan.from_module(net, seq_len=8)
    assert w.layers == 3 and [u.name for u in w.units if u.attention] == [f"blocks.{i}.attn" for i in range(3)]


def test_ring_costs():
    r = Ring(4, 1e9, 1e-5)
    assert r.all_gather(4e9) == pytest.approx(1e-5 + 3.0)
    assert r.all_reduce(4e9) == pytest.approx(2 * (1e-5 + 3.0))
    assert Ring(1, 1e9, 1e-5).all_gather(1e9) == 0.0
    h100 = plan.cluster_preset("h100")
    assert dp_ring(h100, 8).bw == h100.intra_bw
    assert dp_ring(h100, 64).bw == min(h100.intra_bw, h100.inter_bw)          # 8 rings share a node's NICs
    assert dp_ring(h100, 64, tp=8).bw == pytest.approx(h100.inter_bw / 8)     # one rank per node per ring


def test_model_states_are_the_papers_with_the_engines_fp32_gradient():
    w = plan.from_params(7.5e9)
    for stage in range(4):
        r = plan.simulate(w, plan.cluster_preset("v100-32gb"), plan.RunConfig(stage, 64, dtype="fp16"))
        # the engine keeps the reduced gradient in fp32 (4 bytes, the paper counts 2), a shard from stage 1 on
        grads = memory.model_state_bytes(w.params, 64, max(stage, 2) if stage else 0, "fp16", grad_dtype="fp32").grads
        paper = memory.model_state_bytes(w.params, 64, stage, "fp16")
        assert r.memory["states"] == paper.params + grads + paper.optimizer
        assert r.peak_bytes > r.memory["allocated"] > r.memory["states"]
    # with accumulation, stages 0-1 also hold autograd's full 16-bit gradient between micro-batches
    accum = plan.simulate(w, plan.cluster_preset("v100-32gb"), plan.RunConfig(1, 64, accum=2, dtype="fp16"))
    one = plan.simulate(w, plan.cluster_preset("v100-32gb"), plan.RunConfig(1, 64, dtype="fp16"))
    assert accum.memory["states"] - one.memory["states"] == 2 * w.params


def test_gradients_are_bucketed_in_the_reduce_dtype():
    w = plan.from_module(lambda: __import__("torch").nn.Sequential(
        *[__import__("torch").nn.Linear(1024, 1024) for _ in range(64)]), seq_len=128, hidden=1024)
    h100 = plan.cluster_preset("h100")
    fp32 = plan.simulate(w, h100, plan.RunConfig(2, 8, bucket_bytes=4 * 2**20))
    bf16 = plan.simulate(w, h100, plan.RunConfig(2, 8, bucket_bytes=4 * 2**20, reduce_dtype="bf16"))
    assert fp32.collectives > bf16.collectives  # the engine reduces in fp32 by default: twice the bytes
    with pytest.raises(ValueError, match="reduce_dtype"):
        plan.RunConfig(2, 8, reduce_dtype="fp8")


def test_cpu_workers_share_the_cores_and_recompute_costs_backward_time():
    w = plan.model_preset("gpt2", seq_len=128)
    cpu = plan.cluster_preset("cpu", gpus_per_node=4, cores=2.0)
    assert cpu.core_share(1) == 1.0 and cpu.core_share(2) == 1.0 and cpu.core_share(4) == 2.0
    two = plan.simulate(w, cpu, plan.RunConfig(0, 2, dtype="fp32", checkpointing=False))
    four = plan.simulate(w, cpu, plan.RunConfig(0, 4, dtype="fp32", checkpointing=False))
    assert four.compute_s == pytest.approx(2 * two.compute_s)
    spare = plan.simulate(w, cpu.with_(cores=4.0), plan.RunConfig(0, 2, dtype="fp32", checkpointing=False))
    assert cpu.saturated(2) and not cpu.with_(cores=4.0).saturated(2)
    # every core busy: a collective hides beside the compute only in the measured share (1 unmeasured)
    none = plan.simulate(w, cpu.with_(busy_overlap=0.0), plan.RunConfig(0, 2, dtype="fp32", checkpointing=False))
    half = plan.simulate(w, cpu.with_(busy_overlap=0.5), plan.RunConfig(0, 2, dtype="fp32", checkpointing=False))
    assert none.exposed_comm_s > half.exposed_comm_s > spare.exposed_comm_s
    assert none.compute_s == pytest.approx(spare.compute_s) and two.step_s == pytest.approx(spare.step_s)
    h100 = plan.cluster_preset("h100")
    none, half, full = (plan.simulate(w, h100, plan.RunConfig(3, 8, checkpointing=False, recompute=f))
                        for f in (0.0, 0.5, 1.0))
    assert none.compute_s < half.compute_s < full.compute_s
    assert full.compute_s == pytest.approx(plan.simulate(w, h100, plan.RunConfig(3, 8, checkpointing=True)).compute_s)
    with pytest.raises(ValueError, match="recompute"):
        plan.RunConfig(3, 8, recompute=1.5)


def test_ranks_step_at_the_slowest_ranks_pace():
    w = plan.model_preset("gpt2", seq_len=128)
    cpu = plan.cluster_preset("cpu", gpus_per_node=2, cores=2.0)
    cfg = plan.RunConfig(0, 2, dtype="fp32", checkpointing=False)
    even, uneven = plan.simulate(w, cpu, cfg), plan.simulate(w, cpu.with_(straggler=1.25), cfg)
    assert uneven.compute_s == pytest.approx(1.25 * even.compute_s)
    assert uneven.step_s > even.step_s + 0.2 * even.compute_s
    # a single worker waits for no one
    one = plan.RunConfig(0, 1, dtype="fp32", checkpointing=False)
    assert plan.simulate(w, cpu.with_(straggler=1.25), one).step_s == pytest.approx(plan.simulate(w, cpu, one).step_s)
    with pytest.raises(ValueError, match="straggler"):
        cpu.with_(straggler=0.9)


def test_stage3_replays_the_engines_schedule():
    w = plan.model_preset("llama-7b")
    cfg = plan.RunConfig(3, 16, accum=2)
    sched = replay._stage3_schedule(len(w.units), [u.params * 2 for u in w.units], cfg,
                                    replay.window_bytes(w, cfg))
    assert isinstance(sched, Schedule) and len(sched.groups) >= len(w.units)
    r = plan.simulate(w, plan.cluster_preset("h100"), cfg)
    gathers = 2 * len(sched.groups)
    assert r.collectives > gathers  # plus each micro-batch's reduce-scatters
    no_prefetch = plan.simulate(w, plan.cluster_preset("h100", inter_bw=1e9), plan.RunConfig(3, 16, prefetch_bytes=0))
    prefetch = plan.simulate(w, plan.cluster_preset("h100", inter_bw=1e9), plan.RunConfig(3, 16))
    assert prefetch.exposed_comm_s < no_prefetch.exposed_comm_s


def test_one_worker_exposes_no_communication_and_mfu_is_consistent():
    w = plan.model_preset("llama-7b")
    c = plan.cluster_preset("h200")
    r = plan.simulate(w, c, plan.RunConfig(0, 1, checkpointing=False))
    assert r.exposed_comm_s == 0.0 and r.collectives == 0 or r.exposed_comm_s < 1e-3
    assert r.mfu == pytest.approx(w.flops_per_token * r.tokens_per_s / c.peak_flops)
    assert r.mfu < c.achieved


def test_slower_links_expose_more_communication():
    w = plan.model_preset("llama-7b")
    fast = plan.simulate(w, plan.cluster_preset("h100"), plan.RunConfig(0, 64))
    slow = plan.simulate(w, plan.cluster_preset("h100", inter_bw=5e9), plan.RunConfig(0, 64))
    assert slow.step_s > fast.step_s and slow.exposed_comm_s > fast.exposed_comm_s


def test_largest_models_follow_the_stages():
    largest = plan.largest_models(plan.cluster_preset("v100-32gb"), 64, dtype="fp16")
    sizes = [largest[str(s)] for s in range(4)]
    assert sizes == sorted(sizes) and sizes[0] > 1e9
    # model states alone, as the engine holds them (fp32 gradient; stage 1 keeps its shard, as stage 2),
    # bound each: activations, buffers and slack only take memory away
    for s in range(4):
        assert sizes[s] <= memory.max_params_that_fit(32e9, 64, 2 if s == 1 else s, "fp16", grad_dtype="fp32")


def test_choose_stage():
    w = plan.model_preset("llama-7b")
    stage, table, reason = plan.choose_stage(w, plan.cluster_preset("h100", memory_bytes=400e9), 1)
    assert stage == 0 and reason.startswith("stage 0 is the cheapest")  # one worker: equal steps, the simplest wins
    stage, table, reason = plan.choose_stage(w, plan.cluster_preset("h100", memory_bytes=400e9), 8)
    rows = table["stages"]
    assert all(r["fits"] for r in rows.values())
    assert rows[str(stage)]["step_s"] <= min(r["step_s"] for r in rows.values()) / (1 - plan.planner.TIE)
    stage, table, reason = plan.choose_stage(w, plan.cluster_preset("h100", memory_bytes=50e9), 8)
    assert stage == 3 and not table["stages"]["2"]["fits"]
    with pytest.raises(ValueError, match=r"no ZeRO stage fits .* workers"):
        plan.choose_stage(w, plan.cluster_preset("h100", memory_bytes=20e9), 2, checkpointing=True)


def test_cli_largest_json(capsys):
    assert main(["plan", "--largest", "--gpus", "64", "--gpu-memory", "32GB", "--dtype", "fp16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["largest"]) == {"0", "1", "2", "3"}
    assert out["largest_states_only"]["3"] == memory.max_params_that_fit(32e9, 64, 3, "fp16")


def test_cli_plan_table(capsys):
    assert main(["plan", "--model", "llama-7b", "--gpus", "8", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "recommended: stage" in out and "tok/s/GPU" in out
    assert main(["plan", "--gpus", "8"]) == 2
