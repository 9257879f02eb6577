"""Fine-tune a Hugging Face causal LM on your own text with zeroray, then export it for from_pretrained.

    python examples/make_tiny_hf.py tiny                  # a small model and text, made here (no download)
    python examples/finetune_hf.py --model tiny/model --data tiny/text.jsonl --export-dir tiny/finetuned
    python examples/finetune_hf.py --model tiny/model --data tiny/text.txt --lora --export-dir tiny/lora-merged

--model: a directory ``save_pretrained`` wrote (config.json, safetensors weights, tokenizer files);
--data: a UTF-8 text file (documents separated by blank lines) or JSONL (one {"text": ...} a line).
The model's own tokenizer (AutoTokenizer from --model) encodes the text; each batch is padded to its
own longest sequence. Training runs on 2 workers at ZeRO stage 3 in bf16 (--num-workers, --stage,
--dtype), with --lora for peft's LoRA adapters in place of every weight. Every --eval-every steps the
held-out split's perplexity is printed; at the end the job greedy-generates a sample from --prompt,
exports the model (with --lora: the adapters merged into the base weights, a plain model that
from_pretrained loads without peft) and checks that from_pretrained loads the export with the
trained weights and the trained model's logits.

Stop and go on at another size (the global batch stays --batch-size: 12 splits evenly over 2, 3, 4
and 6 workers):

    python examples/finetune_hf.py --model tiny/model --data tiny/text.jsonl --checkpoint-dir tiny/ckpts \\
        --checkpoint-every 20 --stop-after 40
    python examples/finetune_hf.py --model tiny/model --data tiny/text.jsonl --checkpoint-dir tiny/ckpts \\
        --checkpoint-every 20 --resume latest --num-workers 3 --export-dir tiny/finetuned

See [Note: resuming a fine-tuning run] below, and [Note: the loss of a padded batch] in hf_text.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

import hf_text  # beside this script: zr.Trainer sends its code to the workers, wherever they run
from hf_text import InputError

import zeroray as zr
from zeroray.checkpoint import CheckpointError, checkpoint_dir, latest_checkpoint, list_checkpoints, load_manifest
from zeroray.hf import INDEX_NAME, SINGLE_NAME, export_checkpoint, export_pretrained, pretrained

# [Note: resuming a fine-tuning run]
# --resume continues from a sharded checkpoint at any --num-workers, --stage or --dtype, as
# examples/train_gpt.py does ([Note: resuming the main job] there): --steps is the run's total,
# the batches are regenerated from --seed and fit skips those the checkpoint had consumed. What
# decides which rows each step sees and what the model is must not change: the model, the data,
# --text-field, --max-length, --eval-fraction, --batch-size, --seed and the LoRA settings. A fresh
# run writes them to RUN_FILE in --checkpoint-dir; a resume compares and refuses a change before
# anything starts. The global batch stays --batch-size rows whatever --num-workers is, and the
# loss is the batch's per-token mean at any worker count ([Note: the loss of a padded batch] in
# hf_text.py), so the resumed run goes on as one uninterrupted run. A --batch-size that does not
# split evenly over --num-workers is refused here: the default, 12, splits over 2, 3, 4 and 6.
RUN_FILE = "finetune_run.json"
KEPT = ("model", "data", "text_field", "max_length", "eval_fraction", "batch_size", "seed", "lora", "lora_r",
        "lora_alpha", "lora_targets")

# [Note: the export check]
# The export is loaded back with from_pretrained and compared with the trained model twice.
# Weights: every tensor from_pretrained loaded equals the trained fp32 weights (with --lora: the
# base weights plus the merged adapters, computed in fp32 on the driver), exactly for an fp32
# export, and as their bf16 rounding for a bf16 one. Logits: the loaded model, run in the dtype the
# trainer computes in, against the trainer's own forward on the workers (trainer.run) on the
# prompt. Both run the same bf16 weights through the same operations, so they differ at most by
# the order of floating-point sums (a gathered stage-3 unit against a whole module, merged LoRA
# weights against the adapter's separate product); the tolerance is LOGIT_ULPS units in the last
# place of bf16 at the largest logit (bf16 keeps 8 significant bits, so one unit is 2^-7 of a
# value's leading power of two): a few roundings, where a wrong export (an untrained or stale
# weight, an unmerged adapter) moves logits by whole units. The job prints the distance of the
# model before training too, to show the check can fail.
LOGIT_ULPS = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a causal LM directory that save_pretrained wrote, with its tokenizer")
    p.add_argument("--data", required=True, help="a UTF-8 text file or a JSONL file")
    p.add_argument("--text-field", default="text", help="the JSONL field that holds the text")
    p.add_argument("--max-length", type=int, default=64, help="longest sequence in tokens; longer texts are cut")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="share of the documents held out")
    p.add_argument("--eval-every", type=int, default=20, metavar="N", help="evaluate every N steps (and at the end)")
    p.add_argument("--batch-size", type=int, default=12, help="global batch in sequences, split over the workers")
    p.add_argument("--steps", type=int, default=60, help="the run's total optimizer steps")
    p.add_argument("--lr", type=float, default=None, help="AdamW's learning rate (default 2e-3, with --lora 1e-2)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--lora", action="store_true", help="train peft LoRA adapters, the base weights frozen")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=int, default=16)
    p.add_argument("--lora-targets", default=None,
                   help="comma-separated module names to adapt (default: peft's choice for the architecture)")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--checkpoint-dir", default=None, help="save sharded checkpoints here (and at the end)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N")
    p.add_argument("--stop-after", type=int, default=None, metavar="K",
                   help="stop after step K, saved; --resume goes on to --steps")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH|latest",
                   help="continue from the newest checkpoint under --checkpoint-dir, or from PATH")
    p.add_argument("--export-dir", default=None, help="at the end, write the model here for from_pretrained")
    p.add_argument("--export-dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--prompt", default="The ")
    p.add_argument("--new-tokens", type=int, default=30)
    p.add_argument("--metrics", default=None, help="append per-step metrics to this JSONL file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("max_length", "eval_every", "batch_size", "num_workers", "lora_r", "lora_alpha", "new_tokens",
                 "checkpoint_every", "stop_after"):
        value = getattr(args, name)
        if value is not None and value < (2 if name == "max_length" else 1):
            p.error(f"--{name.replace('_', '-')} {value}: it must be >= {2 if name == 'max_length' else 1}")
    if args.lr is None:
        args.lr = 1e-2 if args.lora else 2e-3
    if args.steps < 0 or not 0 <= args.eval_fraction < 1:
        p.error("--steps must be >= 0 and --eval-fraction in [0, 1)")
    if args.batch_size % args.num_workers:
        p.error(f"--batch-size {args.batch_size} does not split evenly over --num-workers {args.num_workers}: "
                "choose a batch size divisible by every worker count the run will use (12: 2, 3, 4 or 6 workers)")
    if args.checkpoint_dir is None and (args.checkpoint_every or args.stop_after or args.resume == "latest"):
        p.error("--checkpoint-every, --stop-after and --resume latest need --checkpoint-dir DIR")
    return args


# --- what the run reads --------------------------------------------------------------------------


def causal_lm_config(path: str):
    """The config of the causal LM saved in ``path``, or an InputError saying what is wrong."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        what = "holds no config.json" if os.path.isdir(path) else "is not a directory"
        raise InputError(f"--model {path} {what}: give the directory that model.save_pretrained(dir) wrote "
                         "(config.json, model.safetensors) with tokenizer.save_pretrained(dir) beside it")
    if not any(os.path.isfile(os.path.join(path, name)) for name in (SINGLE_NAME, INDEX_NAME)):
        raise InputError(f"--model {path} holds no {SINGLE_NAME} (nor {INDEX_NAME}): save the model with "
                         "model.save_pretrained(dir), whose safetensors files zeroray reads by slice")
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError) as e:
        raise InputError(f"--model {path}: its config.json cannot be read ({str(e).splitlines()[0]})") from None
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    saved_as = list(getattr(config, "architectures", None) or [])
    if saved_as and not set(saved_as) & causal or config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise InputError(f"--model {path} is a {', '.join(saved_as) or config.model_type} model, not a causal "
                         "language model (AutoModelForCausalLM): this job trains next-token prediction; give "
                         "a model saved from a *ForCausalLM class (GPT-2, Llama, Qwen, ...)")
    return config


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError, TypeError) as e:
        raise InputError(f"--model {path} has no tokenizer that AutoTokenizer loads ({str(e).splitlines()[0]}): "
                         "save the model's tokenizer beside it with tokenizer.save_pretrained(dir)") from None
    if tokenizer.pad_token_id is None:  # GPT-2's: pad with end-of-text; the collator masks padding by length
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token_id is None:
        raise InputError(f"the tokenizer of {path} has neither a padding nor an end-of-text token: add one "
                         "(tokenizer.add_special_tokens) and save it again")
    return tokenizer


class LoraModel:
    """A picklable model_fn: the saved model with peft LoRA adapters, its base weights frozen.

    from_pretrained reads the whole base model on every worker: zeroray shards what trains (the
    adapters, and their optimizer state) and keeps frozen weights whole on every worker, so each
    worker holds the base whole anyway; the Trainer builds it whole (ZeroConfig(sharded_init=False)),
    as from_pretrained cannot run on the meta device that a sharded build starts from."""

    def __init__(self, path: str, r: int, alpha: int, targets) -> None:
        self.path, self.r, self.alpha, self.targets = path, r, alpha, targets

    def config(self):
        from peft import LoraConfig

        return LoraConfig(task_type="CAUSAL_LM", r=self.r, lora_alpha=self.alpha, lora_dropout=0.0,
                          target_modules=self.targets)

    def __call__(self) -> torch.nn.Module:
        import warnings

        from peft import get_peft_model
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        with warnings.catch_warnings():  # peft 0.21 calls a transformers 5 method that transformers deprecates
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return get_peft_model(AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32), self.config())


def model_fn_of(args):
    if not args.lora:
        return pretrained(args.model)  # each worker reads only its own slices of the weights
    try:
        import peft  # noqa: F401
    except ImportError:
        raise InputError("--lora needs the peft package: pip install 'zeroray[hf]' (or pip install peft)") from None
    targets = args.lora_targets.split(",") if args.lora_targets else None
    return LoraModel(os.path.abspath(args.model), args.lora_r, args.lora_alpha, targets)


# --- resuming ------------------------------------------------------------------------------------


def resume_point(args):
    """The checkpoint to continue from, or None for a fresh run; InputError where the run would lose
    or mix work ([Note: resuming a fine-tuning run])."""
    settings = {k: getattr(args, k) for k in KEPT}
    settings["model"], settings["data"] = os.path.abspath(args.model), os.path.abspath(args.data)
    run_file = os.path.join(args.checkpoint_dir, RUN_FILE) if args.checkpoint_dir else None
    if args.resume is None:
        if args.checkpoint_dir and latest_checkpoint(args.checkpoint_dir) is not None:
            raise InputError(f"{args.checkpoint_dir} already holds a checkpoint that this fresh run's saves would prune: "
                             "continue that run with --resume latest, or pass another --checkpoint-dir")
        if run_file:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            with open(run_file, "w") as f:
                json.dump(settings, f, indent=1)
        return None
    try:
        found = latest_checkpoint(args.checkpoint_dir) if args.resume == "latest" else checkpoint_dir(args.resume)
    except CheckpointError as e:
        raise InputError(f"no checkpoint at {args.resume} ({e}): run without --resume first") from None
    if found is None:
        raise InputError(f"no checkpoint under {args.checkpoint_dir}: run without --resume first")
    root = args.checkpoint_dir or os.path.dirname(os.path.abspath(str(found)))
    try:
        with open(os.path.join(root, RUN_FILE)) as f:
            saved = json.load(f)
    except OSError:
        raise InputError(f"{root} has no {RUN_FILE}: it was not written by this job, which needs the run's "
                         "settings to continue it") from None
    changed = [f"--{k.replace('_', '-')} {saved.get(k)!r} -> {settings[k]!r}" for k in KEPT if saved.get(k) != settings[k]]
    if changed:
        raise InputError(f"{found} belongs to a run with other settings ({'; '.join(changed)}): resume with the "
                         "run's own settings, or the batches would not continue where they stopped")
    return str(found)


# --- after training ------------------------------------------------------------------------------


def generate(model, ids, new_tokens, pad_id):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=pad_id)


def logits_of(model, ids):
    return model(input_ids=ids).logits.float()


def trained_weights(args, state):
    """The weights to export, as a state dict of the plain model: the trainer's, or with --lora the
    base weights with the adapters merged into them (computed in fp32 here, on the driver)."""
    if not args.lora:
        return state
    lora = model_fn_of(args)
    model = lora()
    model.load_state_dict(state, strict=True)
    return model.merge_and_unload().state_dict()


def export(args, trainer, weights, tokenizer) -> str:
    """Writes --export-dir: from the last checkpoint when there is one (streamed, a tensor at a time),
    else from the weights gathered to the driver; with --lora the merged weights."""
    saved = dict(list_checkpoints(args.checkpoint_dir)) if args.checkpoint_dir else {}
    if not args.lora and trainer.step_count in saved:
        export_checkpoint(saved[trainer.step_count], args.export_dir, config=args.model, dtype=args.export_dtype)
        how = f"from checkpoint {saved[trainer.step_count]} (zeroray export-hf)"
    else:
        export_pretrained(weights, args.export_dir, config=args.model, dtype=args.export_dtype)
        how = "the LoRA adapters merged into the base weights" if args.lora else "from trainer.state_dict()"
    tokenizer.save_pretrained(args.export_dir)
    return how


def check_export(args, trainer, weights, ids) -> str:
    """[Note: the export check]; raises AssertionError when it fails."""
    from transformers import AutoModelForCausalLM

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.export_dtype]
    loaded = AutoModelForCausalLM.from_pretrained(args.export_dir)
    got = loaded.state_dict()
    assert set(got) == set(weights), f"the export's names differ: {sorted(set(got) ^ set(weights))[:5]}"
    for name, value in weights.items():
        want = value.to(dtype) if value.is_floating_point() else value
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), f"{name} differs from the trained weight"
    compute = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    trained = trainer.run(logits_of, ids)
    with torch.no_grad():
        exported = logits_of(loaded.to(compute), ids)
        before = logits_of(AutoModelForCausalLM.from_pretrained(args.model).to(compute), ids)
    scale = 2.0 ** math.floor(math.log2(trained.abs().max().item()))
    eps = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[compute]
    tolerance = LOGIT_ULPS * eps * scale
    diff, untrained = (exported - trained).abs().max().item(), (before - trained).abs().max().item()
    assert diff <= tolerance, (f"the exported model's logits are {diff:.3g} from the trained model's, more than "
                               f"{tolerance:.3g} ({LOGIT_ULPS} {args.dtype} units at the largest logit)")
    return (f"from_pretrained loads all {len(got)} tensors equal to the trained weights ({args.export_dtype}); "
            f"logits on a held-out text of {ids.shape[1]} tokens within {diff:.3g} of the trained model's (tolerance {tolerance:.3g}: "
            f"{LOGIT_ULPS} {args.dtype} units at the largest logit; the model before training is {untrained:.3g} away)")


def perplexity(evaluation) -> float:
    return math.exp(evaluation["nll"] / evaluation["tokens"])


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    resume_from = resume_point(args)
    causal_lm_config(args.model)
    tokenizer = load_tokenizer(args.model)
    train_docs, eval_docs = hf_text.split(hf_text.read_texts(args.data, args.text_field), args.eval_fraction, args.seed)
    pad = tokenizer.pad_token_id
    train_rows = hf_text.tokenize(tokenizer, train_docs, args.max_length)
    data = hf_text.Batches(train_rows, args.batch_size, args.steps, pad, args.seed)
    evals = (hf_text.eval_batches(hf_text.tokenize(tokenizer, eval_docs, args.max_length), args.batch_size, pad)
             if eval_docs else None)
    model_fn = model_fn_of(args)
    options = dict(optimizer=zr.AdamW(lr=args.lr, weight_decay=args.weight_decay),
                   zero=zr.ZeroConfig(stage=args.stage, dtype=args.dtype, max_grad_norm=1.0, sharded_init=not args.lora),
                   scaling=zr.ScalingConfig(num_workers=args.num_workers),
                   checkpoint=zr.CheckpointConfig(path=args.checkpoint_dir, every_steps=args.checkpoint_every, keep=2),
                   seed=args.seed, metrics_path=args.metrics)
    t0 = time.perf_counter()
    if resume_from is None:
        trainer = zr.Trainer(model_fn, hf_text.loss_fn, **options)
    else:
        trainer = zr.Trainer.restore(resume_from, model_fn, hf_text.loss_fn, **options)
    trainable = sum(trainer.layout.slots[n].numel for n in trainer.layout.param_names)
    print(f"model {args.model}: {trainable / 1e3:.1f}k trainable parameters{' (LoRA adapters)' if args.lora else ''}, "
          f"ZeRO stage {args.stage}, {args.dtype}, {trainer.num_workers} workers, global batch {args.batch_size} "
          f"sequences of up to {args.max_length} tokens; {len(train_rows)} training sequences, "
          f"{sum(len(b['input_ids']) for b in evals or [])} held out", flush=True)
    if resume_from is not None:
        print(f"resumed from {resume_from}: step {trainer.step_count} of {args.steps}, saved by "
              f"{load_manifest(resume_from).world_size} worker(s), continuing with {trainer.num_workers}", flush=True)
    elif evals:
        before = trainer.evaluate(evals, hf_text.metric_fn)
        print(f"step 0: held-out loss {before['loss']:.4f}, perplexity {perplexity(before):.2f}", flush=True)
    until = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    results = trainer.fit(data, num_steps=max(0, until - trainer.step_count), eval_data=evals,
                          eval_every=args.eval_every if evals else None,
                          eval_metric_fn=hf_text.metric_fn if evals else None)
    first = 0
    for i, r in enumerate(results):
        if r.evaluation is not None:
            mean = sum(x.loss for x in results[first:i + 1]) / (i + 1 - first)
            print(f"step {r.step}: train loss {mean:.4f} (mean of steps {results[first].step}-{r.step}), held-out "
                  f"loss {r.evaluation['loss']:.4f}, perplexity {perplexity(r.evaluation):.2f}", flush=True)
            first = i + 1
    if results:
        print(f"trained steps {results[0].step}-{results[-1].step} in {time.perf_counter() - t0:.1f}s "
              f"(with start-up); losses: {', '.join(f'{r.loss:.4f}' for r in results)}", flush=True)
    if args.checkpoint_dir:
        saved = dict(list_checkpoints(args.checkpoint_dir))
        print(f"checkpoint: {saved.get(trainer.step_count) or trainer.save(args.checkpoint_dir)}", flush=True)
    if trainer.step_count < args.steps:
        print(f"stopped at step {trainer.step_count} of {args.steps}: continue with --resume latest "
              "(any --num-workers that divides --batch-size)", flush=True)
        trainer.shutdown()
        return 0
    prompt_ids = torch.tensor([tokenizer(args.prompt)["input_ids"]], dtype=torch.long)
    out = trainer.run(generate, prompt_ids, args.new_tokens, pad)
    print(f"sample: {tokenizer.decode(out[0], skip_special_tokens=True)!r}", flush=True)
    if args.export_dir:
        weights = trained_weights(args, trainer.state_dict())
        how = export(args, trainer, weights, tokenizer)
        print(f"exported to {args.export_dir} ({how}, {args.export_dtype})", flush=True)
        text = evals[0]["input_ids"][:1, :int(evals[0]["attention_mask"][0].sum())] if evals else prompt_ids
        print(f"export check: {check_export(args, trainer, weights, text)}", flush=True)
    trainer.shutdown()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InputError as error:
        sys.exit(f"error: {error}")
