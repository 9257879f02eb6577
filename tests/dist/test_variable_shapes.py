"""Batches whose rows change shape every step, as a padding collator makes them (issue 24).

Hugging Face's GPT2LMHeadModel (tiny config, built in code) trains on the dicts of its own
padding collator (tests/padded_data.py: ``input_ids``, ``attention_mask``, ``labels`` with -100
at the padding), padded to a different length every step, at stages 0-3 on 2 workers, and
must equal PyTorch with DDP's loss semantics. DDP's global loss is the mean of the workers'
losses, and each worker's loss is HF's mean over its own non-padding tokens (not the mean
over all the global batch's tokens: the workers' token counts differ). So the single-process
oracle computes ``loss_fn`` on each worker's rows separately and averages those, then steps;
the weights must equal that oracle's, within what torch DDP on the same batches shows against
it ([Note: parity bound] in tests/dist/parity.py; DDP's run shares the engines' processes).
Stage 3's prefetch trace records module events, not shapes: after the first step (which
negotiates its fetches and records the trace), every step must follow the trace (no negotiated
rounds, no plan exits) whatever its length.
"""
import torch

import zeroray as zr
from tests.dist.ddp_run import ddp_spec, fused_adamw
from tests.dist.harness import run_engines
from tests.dist.parity import assert_parity, ddp_state
from tests.padded_data import hf_loss, padded_batches
from tests.real_models import hf_gpt2
from zeroray.engine.batch import split_batch

WORLD = 2
LONGEST = (6, 11, 4, 16, 9)  # the padded length of each step's batch
# AdamW eps=1e-5 as in tests/dist/test_real_models.py (its comment says why: attention's key bias).
ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-5)


def reference(batches, parts=WORLD, states=None):
    """Single-process PyTorch with DDP's loss: per step, the mean over the workers' shares of
    ``hf_loss`` on each share alone (``parts=1``: HF's loss over the whole global batch).
    ``states``: a dict that receives the state dict after each step, by step count."""
    torch.manual_seed(0)
    model = hf_gpt2()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, norms = [], []
    for step, batch in enumerate(batches, start=1):
        opt.zero_grad()
        loss = sum(hf_loss(model, share) for share in split_batch(batch, parts)) / parts
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        opt.step()
        losses.append(loss.item())
        if states is not None:
            states[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_changing_sequence_lengths_match_ddp_semantics():
    batches = padded_batches(LONGEST, rows=2 * WORLD)
    assert [b["input_ids"].shape[1] for b in batches] == list(LONGEST)
    assert all((b["labels"] == -100).any() for b in batches[:2])  # padding, masked in the labels
    ref_losses, ref_norms, ref_state = reference(batches)
    global_mean_state = reference(batches, parts=1)[2]  # the semantics DDP does not have
    specs = [dict(model_fn=hf_gpt2, loss_fn=hf_loss, optimizer=zr.AdamW(**ADAMW), zero=zr.ZeroConfig(stage=stage),
                  batches=batches) for stage in range(4)]
    ddp_run = ddp_spec(model_fn=hf_gpt2, loss_fn=hf_loss, optimizer=fused_adamw(**ADAMW), batches=batches)
    *runs, ddp = run_engines(WORLD, specs + [ddp_run])
    for stage, (results, params) in enumerate(runs):
        ref_state_trained = {k: v for k, v in ref_state.items() if k in params}
        assert_parity((ref_losses, ref_norms, ref_state_trained), results, params, ddp=ddp)
        diff = max((params[k].reshape(v.shape) - v).abs().max().item() for k, v in ref_state_trained.items())
        other = max((params[k].reshape(v.shape) - global_mean_state[k]).abs().max().item()
                    for k, v in ref_state_trained.items())
        assert other > 1e-3  # the test tells the two loss semantics apart
        print(f"stage {stage}: max |weight - DDP-semantics oracle| = {diff:.2e} (torch DDP's: "
              f"{max((ddp_state(ddp)[k] - v).abs().max().item() for k, v in ref_state_trained.items()):.2e}) "
              f"(vs the global token mean's weights: {other:.2e})")
    results, _ = runs[3]
    for rank_result in results:
        fetch = [r["fetch"] for r in rank_result["reports"]]
        assert fetch[0]["rounds"] > 0  # the first step negotiates and records the trace
        for step, f in enumerate(fetch[1:], start=1):
            assert f["rounds"] == 0 and f["plan_exits"] == 0, (step, f)  # then every length follows it
            assert f["prefetch_hits"] > 0, (step, f)
