"""Models zeroray did not write, as users bring them: torch's own nn.MultiheadAttention, a
nanoGPT-style model (root-level init, a functional tied head), and Hugging Face transformers
models built from tiny configs in code (nothing is downloaded).

Every factory is a plain ``() -> nn.Module``; ``real_loss`` trains each of them as a
next-token language model on ``real_batches``.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 64, 16, 32, 4, 2


class MHABlock(nn.Module):
    """A pre-norm transformer block around torch's nn.MultiheadAttention, whose forward reads
    ``out_proj.weight`` without calling ``out_proj`` and whose constructor writes a child's bias."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class MHAGPT(nn.Module):
    def __init__(self, block: type = MHABlock) -> None:  # block: another block of the same shape
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class NanoBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.mlp_proj = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's habits: the root initialises every child (``self.apply``), then rescales the
    residual projections, and the output head is ``x @ wte.weight.t()`` in the root's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(SEQ, WIDTH)
        self.h = nn.ModuleList(NanoBlock() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * LAYERS))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
                       max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def hf_gpt2() -> nn.Module:
    """transformers' GPT2LMHeadModel (tied head, Conv1D layers, post_init from the root)."""
    _quiet_transformers()
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(gpt2_config())


def hf_llama() -> nn.Module:
    """transformers' LlamaForCausalLM (RMSNorm, rotary inv_freq buffers, GQA, untied head)."""
    _quiet_transformers()
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config())


def hf_glm4_moe() -> nn.Module:
    """transformers' Glm4MoeForCausalLM: a mixture of experts whose routers (``gate.weight`` and the
    ``e_score_correction_bias`` buffer) the model keeps in fp32 under every low dtype
    (``_keep_in_fp32_modules_strict``); the second layer is the MoE one."""
    _quiet_transformers()
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    return Glm4MoeForCausalLM(Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, moe_intermediate_size=WIDTH // 2,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2, head_dim=WIDTH // HEADS,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
        topk_group=1, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def hf_t5() -> nn.Module:
    """transformers' T5ForConditionalGeneration (tied embeddings, relative position bias), which
    keeps its feed-forward ``wo`` in fp32 under fp16 (``_keep_in_fp32_modules``); train it with
    ``seq2seq_loss``."""
    _quiet_transformers()
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=2 * WIDTH, num_layers=LAYERS,
        num_decoder_layers=LAYERS, num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1))


def mha_gpt() -> nn.Module:
    return MHAGPT()


def nano_gpt() -> nn.Module:
    return NanoGPT()


FACTORIES = {"mha": mha_gpt, "nano": nano_gpt, "hf-gpt2": hf_gpt2, "hf-llama": hf_llama}


def logits_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx)
    return out if isinstance(out, torch.Tensor) else out.logits


def real_loss(model: nn.Module, batch) -> torch.Tensor:
    idx, tgt = batch
    logits = logits_of(model, idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1))


def seq2seq_loss(model: nn.Module, batch) -> torch.Tensor:
    """An encoder-decoder's loss on ``real_batches``: the second tensor is the target sequence,
    fed to the decoder shifted right behind the start token 0 (teacher forcing)."""
    src, tgt = batch
    dec = torch.cat([torch.zeros_like(tgt[:, :1]), tgt[:, :-1]], dim=1)
    logits = model(input_ids=src, decoder_input_ids=dec).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1))


def real_batches(steps: int, batch: int = 12, seed: int = 321):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g))
            for _ in range(steps)]
