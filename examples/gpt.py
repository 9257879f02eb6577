"""A small GPT as a plain ``nn.Module`` and character-level text that ships with Python.

Model code lives apart from parallelism code: nothing here knows about zeroray. The output
layer shares its weight with the token embedding (tied weights), as in GPT-2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    dropout: float = 0.0


class Embedding(nn.Embedding):
    """GPT-2's small initialisation (std 0.02), done in the module's own constructor.

    Parameters are initialised by the module that owns them, never by a parent afterwards:
    that keeps the model compatible with zeroray's sharded construction (stage 3), which
    partitions each module's parameters as soon as that module is built."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied
        # Positions as a non-persistent buffer: replicated, never trained.
        self.register_buffer("pos", torch.arange(cfg.seq_len), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(self.pos[:t])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_loss(model: nn.Module, batch) -> torch.Tensor:
    """Next-character cross entropy, mean over the batch. ``batch`` is (inputs, targets)."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def sample(model: nn.Module, prompt: torch.Tensor, new_tokens: int, temperature: float = 0.8,
           seed: int = 0) -> torch.Tensor:
    """``prompt`` (batch, length) followed by ``new_tokens`` sampled characters: each drawn from the
    last position's softmax at ``temperature`` (0: the most likely one), the context cropped to
    the model's ``seq_len``. Call it without gradients, the model in eval mode (``trainer.run``
    does both)."""
    g = torch.Generator(device=prompt.device).manual_seed(seed)
    idx = prompt
    for _ in range(new_tokens):
        logits = model(idx[:, -model.cfg.seq_len:])[:, -1].float()
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=g)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def load_text() -> bytes:
    """Python's own documentation topics: real English prose shipped with every Python."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


class CharBatches:
    """Re-iterable global batches of (inputs, targets) byte sequences, deterministic per seed."""

    def __init__(self, batch_size: int, seq_len: int, num_steps: int, seed: int = 0) -> None:
        data = torch.frombuffer(bytearray(load_text()), dtype=torch.uint8).long()
        self.data, self.batch_size, self.seq_len, self.num_steps, self.seed = data, batch_size, seq_len, num_steps, seed

    def __len__(self) -> int:
        return self.num_steps

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        for _ in range(self.num_steps):
            starts = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch_size,), generator=g)
            chunk = torch.stack([self.data[s:s + self.seq_len + 1] for s in starts.tolist()])
            yield chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def num_params(cfg: GPTConfig) -> int:
    return sum(p.numel() for p in GPT(cfg).parameters())


def flops_per_token(cfg: GPTConfig) -> float:
    """6N for the matmuls plus attention, forward and backward (Kaplan et al.)."""
    n = 12 * cfg.n_layers * cfg.d_model**2
    return 6 * n + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len

