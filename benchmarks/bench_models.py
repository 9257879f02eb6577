"""The models ``compare.py --model`` trains: the project's GPT, and two it did not write.

- ``gpt``: examples/gpt.py (the main job's model);
- ``mha``: the same sizes built from torch's own ``nn.MultiheadAttention`` (whose forward
  reads ``out_proj.weight`` without calling ``out_proj``);
- ``hf-gpt2``: transformers' ``GPT2LMHeadModel`` from a config of the same sizes (nothing is
  downloaded).
Every one is a plain ``() -> nn.Module`` (``build``), trained by ``lm_loss`` on the same
character batches; ``blocks`` lists the repeated blocks (FSDP2 wraps each).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

MODELS = ("gpt", "mha", "hf-gpt2")


class MHABlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class MHAGPT(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(MHABlock(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build(model: str, vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int) -> nn.Module:
    if model == "gpt":
        from gpt import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, n_layers=n_layers,
                             n_heads=n_heads))
    if model == "mha":
        return MHAGPT(vocab_size, seq_len, d_model, n_layers, n_heads)
    if model == "hf-gpt2":
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel

        transformers.logging.set_verbosity_error()
        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=d_model,
                                          n_layer=n_layers, n_head=n_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    raise ValueError(f"unknown model {model!r}: choose one of {MODELS}")


def blocks(model: nn.Module) -> list:
    """The repeated blocks: every element of the model's ModuleLists."""
    return [m for list_ in model.modules() if isinstance(list_, nn.ModuleList) for m in list_]


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """Next-character cross entropy, mean over the batch (HF models return an output object)."""
    x, y = batch
    out = model(x)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
