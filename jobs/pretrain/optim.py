"""Optimizers and the learning-rate schedule of pre-training, in plain torch (nothing to compile).

- AdamW: the paper's recipe (lr 1e-4, β 0.9/0.999, ε 1e-6, weight decay 0.01 except biases and LayerNorm).
  Unlike the original AdamWeightDecayOptimizer, torch's AdamW applies Adam's bias correction — this only
  changes the first few hundred steps, which warmup already tames.
- LAMB (You et al., 2019) as NVIDIA trains BERT with it: Adam moments with bias correction, decoupled weight
  decay added to the update, and the layer-wise trust ratio ‖w‖/‖update‖ applied only to parameters that
  get weight decay (apex FusedLAMB with use_nvlamb=False). Global gradient clipping is DeepSpeed's.
- Schedule: linear warmup to the peak, then polynomial decay to zero (power 1 = the paper's linear decay,
  0.5 = NVIDIA's LAMB). LambdaLR multiplies the base lr, so the optimizers are built with lr 1.0 and
  `LrSchedule(step)` returns the absolute learning rate.
"""
from __future__ import annotations

import torch
from torch import nn

from bertpipe.jobs.pretrain.config import PretrainConfig
from bertpipe.model.training import param_groups, warmup_decay


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01):
        if lr <= 0 or eps <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr} betas={betas} eps={eps}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_hat = m / (1 - beta1 ** state["step"])
                v_hat = v / (1 - beta2 ** state["step"])
                weight = p.float()
                update = m_hat / (v_hat.sqrt() + group["eps"])
                trust = 1.0
                if group["weight_decay"] != 0:
                    update.add_(weight, alpha=group["weight_decay"])
                    w_norm, u_norm = weight.norm(), update.norm()
                    trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_((update * trust * -group["lr"]).to(p.dtype))
        return loss


def make_optimizer(cfg: PretrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "lamb":
        return Lamb(groups, lr=1.0, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    fused = cfg.use_gpu and torch.cuda.is_available()
    return torch.optim.AdamW(groups, lr=1.0, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             fused=fused or None)


class LrSchedule:
    """step (0-based optimizer step) → absolute learning rate. A callable object (not a lambda) so that
    LambdaLR's state_dict round-trips it in checkpoints."""

    def __init__(self, cfg: PretrainConfig):
        steps = cfg.phase_steps()
        if cfg.lr_schedule == "run":
            first = cfg.phases[0]
            self.segments = [(0, cfg.max_steps, first.learning_rate, first.warmup_steps)]
        else:
            starts = [sum(steps[:i]) for i in range(len(steps))]
            self.segments = [(s, n, ph.learning_rate, ph.warmup_steps)
                             for s, n, ph in zip(starts, steps, cfg.phases)]
        self.power = cfg.decay_power

    def __call__(self, step: int) -> float:
        start, num, peak, warmup = self.segments[0]
        for seg in self.segments:
            if step >= seg[0]:
                start, num, peak, warmup = seg
        return peak * warmup_decay(step - start, num, warmup, self.power)


def make_scheduler(cfg: PretrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, LrSchedule(cfg))
