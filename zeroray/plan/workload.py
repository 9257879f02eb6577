"""The model as a simulator sees it: a list of units, each with parameters, FLOPs and activations.

[Note: workload units]
A unit is what stage 3 gathers with one collective and what the reducer's buckets are packed from:
the embedding, each transformer block, and the final norm with the output head. Per unit:

- ``params``: trainable elements;
- ``matmul_params``: elements that multiply every token (linear weights; a tied embedding counts in
  the head's unit, where it is used as a matmul). Training FLOPs per token are ``6 · matmul_params``
  (forward 2, backward 4) plus, for a block, attention's ``12 · hidden · seq_len`` (QKᵀ and AV, the
  convention of torchtitan and Megatron-LM);
- ``act_bytes_per_token``: the block's residual activations per token at 16 bits
  (``34 · hidden``, Korthikanti et al., attention fused; from a module: on the first unit of each
  ModuleList element) and the checkpoint kept per token
  (``2 · hidden``) when activation checkpointing is on.

Shapes come from a Hugging Face config (Llama and GPT-2 families), a named preset, a bare
parameter count (``from_params``: a GPT shape with ``layers = hidden / 128``), or a real module on
the meta device (``from_module``: the engine's own FlatLayout units; FLOPs from its Linear weights,
Hugging Face Conv1D weights and nn.MultiheadAttention's input projection; the logits' width from its
largest nn.Embedding).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union


@dataclass(frozen=True)
class Unit:
    name: str
    params: int
    matmul_params: int = 0
    attention: bool = False  # a transformer block: attention FLOPs and block activations


@dataclass(frozen=True)
class Workload:
    name: str
    units: Tuple[Unit, ...]
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    layers: int = field(default=0)

    @property
    def params(self) -> int:
        return sum(u.params for u in self.units)

    def unit_flops_per_token(self, u: Unit) -> float:
        """Training FLOPs per token of one unit, without recomputation; see [Note: workload units]."""
        return 6.0 * u.matmul_params + (12.0 * self.hidden * self.seq_len if u.attention else 0.0)

    @property
    def flops_per_token(self) -> float:
        return sum(self.unit_flops_per_token(u) for u in self.units)

    def with_seq_len(self, seq_len: int) -> "Workload":
        return Workload(self.name, self.units, self.hidden, self.heads, seq_len, self.vocab, self.layers)


def _blocks(n: int, per_block: int, matmul: int) -> List[Unit]:
    return [Unit(f"layers.{i}", per_block, matmul, True) for i in range(n)]


def from_hf_config(config: Union[Mapping[str, Any], str], seq_len: Optional[int] = None) -> Workload:
    """Units of a Llama-family (LlamaForCausalLM, Mistral, Qwen2) or GPT-2 config dict or config.json path."""
    if isinstance(config, str):
        with open(config) as f:
            config = json.load(f)
    cfg = dict(config)
    kind = str(cfg.get("model_type", "")).lower()
    if kind == "gpt2" or "n_embd" in cfg:
        h, layers, heads = int(cfg["n_embd"]), int(cfg["n_layer"]), int(cfg["n_head"])
        vocab, positions = int(cfg.get("vocab_size", 50257)), int(cfg.get("n_positions", 1024))
        inner = int(cfg.get("n_inner") or 4 * h)
        block_matmul = 4 * h * h + 2 * h * inner
        block = block_matmul + 3 * h + h + inner + h + 4 * h  # biases and two LayerNorms
        units = [Unit("wte+wpe", vocab * h + positions * h, 0)] + _blocks(layers, block, block_matmul)
        units.append(Unit("ln_f+lm_head(tied)", 2 * h, vocab * h))
        return Workload(cfg.get("_name_or_path", "gpt2"), tuple(units), h, heads, seq_len or positions, vocab, layers)
    try:
        h, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        inter, vocab = int(cfg["intermediate_size"]), int(cfg["vocab_size"])
    except KeyError as e:
        raise ValueError(f"the config has no {e.args[0]!r}: a Llama-family config needs hidden_size, "
                         "num_hidden_layers, num_attention_heads, intermediate_size and vocab_size; GPT-2 needs "
                         "n_embd, n_layer and n_head") from None
    head_dim = int(cfg.get("head_dim") or h // heads)
    block_matmul = h * heads * head_dim * 2 + 2 * h * kv * head_dim + 3 * h * inter
    bias = 2 * kv * head_dim + heads * head_dim if cfg.get("attention_bias") else 0
    block = block_matmul + 2 * h + bias
    tied = bool(cfg.get("tie_word_embeddings", False))
    units = [Unit("embed_tokens", vocab * h, 0)] + _blocks(layers, block, block_matmul)
    units.append(Unit("norm+lm_head" + ("(tied)" if tied else ""), h + (0 if tied else vocab * h), vocab * h))
    seq = seq_len or min(int(cfg.get("max_position_embeddings", 2048)), 8192)
    return Workload(cfg.get("_name_or_path", kind or "llama"), tuple(units), h, heads, seq, vocab, layers)


def from_params(num_params: float, *, seq_len: int = 1024, vocab: int = 50257) -> Workload:
    """A GPT shape of about ``num_params`` parameters: ``12 · layers · hidden²`` with
    ``layers = hidden / 128`` (GPT-3's 13B and 175B shapes), hidden a multiple of 128."""
    if not num_params > 0:
        raise ValueError(f"num_params={num_params!r} is invalid: it must be > 0")
    h = max(128, int(round((num_params * 128 / 12) ** (1 / 3) / 128)) * 128)
    layers = max(1, int(round((num_params - 2 * vocab * h) / (12 * h * h))))
    block = 12 * h * h + 13 * h
    units = [Unit("embed", vocab * h + seq_len * h, 0)] + _blocks(layers, block, 12 * h * h)
    units.append(Unit("head(tied)", 2 * h, vocab * h))
    return Workload(f"gpt-{num_params / 1e9:.3g}B", tuple(units), h, max(1, h // 128), seq_len, vocab, layers)


def _llama(h: int, layers: int, heads: int, kv: int, inter: int, vocab: int, seq: int, name: str) -> Dict[str, Any]:
    return {"model_type": "llama", "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "intermediate_size": inter, "vocab_size": vocab,
            "max_position_embeddings": seq, "_name_or_path": name}


MODEL_PRESETS: Dict[str, Dict[str, Any]] = {
    "llama-7b": _llama(4096, 32, 32, 32, 11008, 32000, 4096, "llama-7b"),
    "llama-13b": _llama(5120, 40, 40, 40, 13824, 32000, 4096, "llama-13b"),
    "llama-70b": _llama(8192, 80, 64, 8, 28672, 32000, 4096, "llama-70b"),
    "llama3-8b": _llama(4096, 32, 32, 8, 14336, 128256, 8192, "llama3-8b"),
    "llama3-70b": _llama(8192, 80, 64, 8, 28672, 128256, 8192, "llama3-70b"),
    "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
             "n_positions": 1024, "_name_or_path": "gpt2"},
}


def model_preset(name: str, seq_len: Optional[int] = None) -> Workload:
    if name.lower() not in MODEL_PRESETS:
        raise ValueError(f"model={name!r} is not a known preset: choose one of {', '.join(MODEL_PRESETS)}, or "
                         "pass --params N or --hf-config config.json")
    return from_hf_config(MODEL_PRESETS[name.lower()], seq_len)


def from_module(model_or_fn: Any, *, seq_len: int = 1024, hidden: int = 0, heads: int = 0,
                wrap: Any = "auto") -> Workload:
    """Units of a real ``nn.Module`` (or a zero-argument function building one, built on the meta
    device) by the engine's own FlatLayout. A unit's ``matmul_params`` are the matmul weights its
    modules use (a tied weight counts in the unit that owns it); ``attention`` marks units with an
    attention module when ``hidden`` is known (given, or read off nn.MultiheadAttention)."""
    import torch

    from zeroray.layout.arena import FlatLayout

    model = model_or_fn
    if not isinstance(model, torch.nn.Module):
        try:
            with torch.device("meta"):
                model = model_or_fn()
        except Exception:  # some constructors read real data; build those for real
            model = model_or_fn()
    layout = FlatLayout.from_module(model, 1, wrap=wrap)
    owner = {id(p): layout.slots[name].unit for name, p in model.named_parameters() if name in layout.slots}
    matmul = [0] * len(layout.units)
    attention = [False] * len(layout.units)
    vocab = 0
    for mod_name, mod in model.named_modules():
        for weight in _matmul_weights(mod):
            if id(weight) in owner:
                matmul[owner[id(weight)]] += weight.numel()
        if isinstance(mod, torch.nn.MultiheadAttention):
            hidden, heads = hidden or mod.embed_dim, heads or mod.num_heads
            for p in mod.parameters():
                if id(p) in owner:
                    attention[owner[id(p)]] = True
                    break
        if isinstance(mod, torch.nn.Embedding) and id(mod.weight) in owner:
            hidden = hidden or mod.embedding_dim
            vocab = max(vocab, mod.num_embeddings)  # the token embedding, the largest: the logits' width
    # A block is one element of an nn.ModuleList/nn.Sequential (the engine's "auto" wrap cuts there); its
    # first unit carries the block's attention FLOPs and activations, whatever units the wrap made of it.
    lists = {name for name, m in model.named_modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))}
    # A block whose nn.MultiheadAttention already marked its unit is counted there, once.
    def block_of(u) -> Optional[str]:
        parts = (u.module or "").split(".")
        return next((".".join(parts[:k + 1]) for k in range(len(parts)) if parts[k].isdigit()
                     and ".".join(parts[:k]) in lists), None)

    seen = {block_of(u) for u in layout.units if attention[u.index]}
    for i, u in enumerate(layout.units):
        block = block_of(u)
        if block is not None and hidden and block not in seen:
            seen.add(block)
            attention[i] = True
    units = tuple(Unit(u.module or f"unit{u.index}", u.numel, matmul[u.index], attention[u.index])
                  for u in layout.units)
    return Workload(type(model).__name__, units, hidden or 1, heads or 1, seq_len, vocab, sum(attention))


def _matmul_weights(mod: Any) -> List[Any]:
    """The weights of ``mod`` that multiply every token: an ``nn.Linear``'s, a Hugging Face ``Conv1D``'s
    (GPT-2's linear layers, the weight transposed), and ``nn.MultiheadAttention``'s input projection
    (a parameter of its own; its output projection is an ``nn.Linear``, found as such)."""
    import torch

    if isinstance(mod, torch.nn.Linear):
        return [mod.weight]
    if type(mod).__name__ == "Conv1D" and getattr(mod, "weight", None) is not None and mod.weight.dim() == 2:
        return [mod.weight]
    if isinstance(mod, torch.nn.MultiheadAttention):
        return [p for p in (mod.in_proj_weight, mod.q_proj_weight, mod.k_proj_weight, mod.v_proj_weight)
                if p is not None]
    return []
