"""A small Hugging Face causal LM and a text data set, made on this machine: nothing is downloaded.

    python examples/make_tiny_hf.py tiny                 # tiny/model, tiny/text.txt, tiny/text.jsonl
    python examples/make_tiny_hf.py tiny --arch gpt2     # a GPT-2 (tied embeddings) instead of a Llama

What examples/finetune_hf.py reads, in the shapes a Hugging Face user has them:
- ``tiny/model/``: what ``save_pretrained`` writes for a model (config.json, model.safetensors) and
  for its tokenizer (tokenizer.json, tokenizer_config.json): a byte-level BPE tokenizer trained
  here with the ``tokenizers`` library on the text below, and a small Llama (or GPT-2) sized to
  its vocabulary, with the random weights of ``torch.manual_seed(--seed)``;
- ``tiny/text.txt``: paragraphs of Python's own documentation (``pydoc_data``, shipped with every
  Python), one per block, separated by blank lines;
- ``tiny/text.jsonl``: the same paragraphs, one ``{"text": ...}`` object a line.

The model is untrained: fine-tuning it is training from scratch at a small scale, which is all the
example needs to show its pieces (losses falling, perplexity, a sample, the export). Point
finetune_hf.py at any other causal LM directory that ``save_pretrained`` wrote, and at your text.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

EOS, PAD = "<|endoftext|>", "<|pad|>"


def paragraphs(min_chars: int = 80):
    """Prose paragraphs of Python's documentation topics, whitespace collapsed, in a fixed order."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            text = " ".join(block.split())
            if len(text) >= min_chars and not text.startswith(("*", ">>>", "...")):
                out.append(text)
    return out


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2's scheme) trained on ``texts``, as a transformers tokenizer
    with an end-of-text token (also the start) and a padding token of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD)


def build_model(arch: str, tokenizer, seed: int, width: int, layers: int, max_positions: int):
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    if arch == "llama":
        config = LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                             **ids)
    else:
        config = GPT2Config(n_embd=width, n_layer=layers, n_head=4, n_positions=max_positions, **ids)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="directory to create: OUT/model, OUT/text.txt, OUT/text.jsonl")
    p.add_argument("--arch", default="llama", choices=["llama", "gpt2"])
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--width", type=int, default=64, help="hidden size")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--max-positions", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model_dir = os.path.join(args.out, "model")
    if os.path.exists(model_dir):
        sys.exit(f"{model_dir} exists already: pass another directory, or remove it first")
    texts = paragraphs()
    tokenizer = train_tokenizer(texts, args.vocab_size)
    model = build_model(args.arch, tokenizer, args.seed, args.width, args.layers, args.max_positions)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with open(os.path.join(args.out, "text.txt"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(texts) + "\n")
    with open(os.path.join(args.out, "text.jsonl"), "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    n = sum(t.numel() for t in model.parameters())
    print(f"{model_dir}: {type(model).__name__}, {n / 1e3:.0f}k parameters, tokenizer of {len(tokenizer)} tokens")
    print(f"{args.out}/text.txt and {args.out}/text.jsonl: {len(texts)} paragraphs of Python's documentation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
