"""Optimizers that are not element-wise, as users bring them, for the whole-parameter path's tests:
a LAMB written here (a per-tensor trust ratio), and the usual Muon recipe (torch.optim.Muon on
the 2-D hidden weights, AdamW on embeddings, the head and every 1-D parameter) as one optimizer.
Each records the shapes it stepped, and the Muon recipe the matrix multiplications its Muon ran
(torch's FlopCounterMode around the step), so a test can check the shape-aware step really ran:
DeepSpeed's Muon was silently 1-D (#8438) and silently plain SGD (#8441)."""
import torch
from torch.utils.flop_counter import FlopCounterMode


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019): Adam's update scaled per tensor by ||w|| / ||update||."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.shapes_seen = []  # the shape of every parameter stepped, in order

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.shapes_seen.append(tuple(p.shape))
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                step = state["step"].item()
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m = state["exp_avg"] / (1 - beta1 ** step)
                v = state["exp_avg_sq"] / (1 - beta2 ** step)
                update = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                trust = (w_norm / u_norm).item() if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * trust)


def lamb(params):
    return Lamb(params, lr=1e-2)


def orthogonalise_fp32(g, ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7):
    """torch.optim.Muon's Newton-Schulz iteration, in fp32 (torch's runs in bf16)."""
    a, b, c = ns_coefficients
    x = g.float()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class MuonFP32(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iteration in fp32. torch's runs it in bf16, whose
    rounding turns the last-bit differences of a gradient summed in another order (over workers,
    or over micro-batches in one process) into differences of the update near 1e-3: this variant
    holds zeroray to float tolerance, torch's own to what torch shows against itself."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalise_fp32(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                rows, cols = p.shape[:2]
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * max(1, rows / cols) ** 0.5)  # adjust_lr_fn "original"


def newton_schulz_flops(shape, ns_steps=5):
    """The multiply-adds (as FlopCounterMode counts them: 2 per) of one Newton-Schulz
    orthogonalisation of a ``shape`` matrix, torch.optim.Muon's and ``orthogonalise_fp32``'s alike:
    per iteration, on the short side m and the long side n, the Gram matrix (m x n by n x m), its
    square (m x m by m x m) and the update (m x m by m x n)."""
    m, n = sorted(shape)
    return ns_steps * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)


def _for_muon(name, p):
    return p.ndim == 2 and not any(k in (name or "") for k in ("emb", "wte", "wpe", "head", "tok", "pos"))


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on the 2-D hidden weights (chosen by name and ndim, as recipes do), AdamW
    on the rest, sharing this optimizer's ``state``: one torch optimizer, as zeroray's spec wants."""

    # AdamW's eps 1e-5, not 1e-8: attention's key bias has an exactly zero gradient in exact arithmetic,
    # whose rounding noise AdamW at 1e-8 normalises into real updates (tests/dist/test_real_models.py).
    def __init__(self, params, lr=0.02, adamw_lr=1e-2, weight_decay=0.01, muon=torch.optim.Muon, adamw_eps=1e-5):
        super().__init__(params, dict(lr=lr, adamw_lr=adamw_lr, weight_decay=weight_decay))
        self.muon_shapes = []  # the shapes Muon stepped, in order
        self.muon_flops = 0  # the matrix multiplications Muon's steps ran, counted by torch
        muon_groups, adamw_groups = [], []
        for g in self.param_groups:
            names = g.get("param_names") or [None] * len(g["params"])
            mats = [p for n, p in zip(names, g["params"]) if _for_muon(n, p)]
            rest = [p for p in g["params"] if not any(p is m for m in mats)]
            muon_groups.append({"params": mats})
            adamw_groups.append({"params": rest})
        self.muon = muon(muon_groups, lr=lr, weight_decay=weight_decay)
        self.adamw = torch.optim.AdamW(adamw_groups, lr=adamw_lr, weight_decay=weight_decay, eps=adamw_eps)
        self._share()

    def _share(self):
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._share()  # load_state_dict made a new state dict

    @torch.no_grad()
    def step(self, closure=None):
        for g, mg, ag in zip(self.param_groups, self.muon.param_groups, self.adamw.param_groups):
            mg["lr"], ag["lr"] = g["lr"], g["adamw_lr"]  # an LR scheduler changes this optimizer's groups
            self.muon_shapes += [tuple(p.shape) for p in mg["params"] if p.grad is not None]
        with FlopCounterMode(display=False) as counted:
            self.muon.step()
        self.muon_flops += counted.get_total_flops()
        self.adamw.step()


def muon_adamw(params):
    return MuonAdamW(params)


def muon_fp32_adamw(params):
    return MuonAdamW(params, muon=MuonFP32)


def adafactor(params):
    return torch.optim.Adafactor(params, lr=1e-2)


def trainable(model):
    """What single-process torch hands an optimizer: the named trainable parameters."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
