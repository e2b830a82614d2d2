"""The optimizer step of DeepSpeed's ZeRO 1/2 without a Python loop over gradients and without a host read.

DeepSpeed 0.19's `DeepSpeedZeroOptimizer.step` computes the global gradient norm with one `vector_norm` per
parameter gradient, each on a float64 copy of the gradient (`get_grad_norm_direct`), and its
`unscale_and_clip_grads` asks `is_invalid_grad_norm(norm)` — a `bool()` of a device tensor, i.e. a wait for the
GPU — once per param group per step. `install_fast_paths` replaces both methods on one optimizer instance:

- the norm: one `torch._foreach_norm` over the gradients (multi-tensor kernels on CUDA), accumulated in the same
  dtype as DeepSpeed's, same filter (no alignment padding, no pipeline-replicated or model-parallel duplicates),
  same all-reduces and the same -1 sentinel for a non-finite norm (chosen on the device);
- the clip factor: DeepSpeed's arithmetic with the invalid-norm case chosen on the device (`torch.where`).

Only the plain layout is touched (no optimizer offload, no MoE, no Muon); anything else keeps DeepSpeed's code.
tests/test_zero_fast_paths.py checks norms and clipped gradients against DeepSpeed's own methods.
"""
from __future__ import annotations

import types
from typing import Any

import torch


def _eligible(zero: Any) -> bool:
    return (not getattr(zero, "cpu_offload", True) and not getattr(zero, "has_moe_layers", True)
            and not getattr(zero, "_uses_muon", False))


def _grad_norm(self, gradients, params, norm_type=2):
    """Drop-in for DeepSpeedZeroOptimizer.get_grad_norm_direct (L2 only; other norms go to DeepSpeed's)."""
    from deepspeed import comm as dist
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if float(norm_type) != 2.0:
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    grads = [g for g in gradients if not getattr(g, "_zero_padding", False)]
    picked = [g for g, p in zip(grads, params)
              if not (hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated)
              and (is_model_parallel_parameter(p) or self.model_parallel_rank == 0)]
    if picked:
        norms = torch._foreach_norm(picked, 2, dtype=get_norm_dtype())
        total = torch.stack(norms).pow(2).sum().float()
    else:
        total = torch.tensor(0.0, dtype=torch.float32).to(self.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    total = total.pow(0.5)
    # DeepSpeed's sentinel for a non-finite norm, without mask_nan_or_inf_with_val_inplace: its masked_fill_ with
    # a tensor value reads that value to the host.
    return torch.where(torch.isfinite(total), total, torch.full_like(total, -1.0))


def _unscale_and_clip(self, grad_groups_flat, total_norm):
    """Drop-in for DeepSpeedZeroOptimizer.unscale_and_clip_grads: the same factor, decided on the device."""
    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        return
    if not torch.is_tensor(total_norm):
        return type(self).unscale_and_clip_grads(self, grad_groups_flat, total_norm)
    combined_scale = self.loss_scale
    if self.clip_grad > 0.:
        valid = torch.isfinite(total_norm) & (total_norm >= 0)
        clip_norm = torch.where(valid, total_norm, torch.full_like(total_norm, float("inf")))
        clip = torch.clamp(((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad, min=1.0)
        combined_scale = clip * self.loss_scale
    for grad in grad_groups_flat:
        for g in (grad if isinstance(grad, list) else [grad]):
            g.data.mul_(1. / combined_scale)


def install_fast_paths(engine: Any) -> bool:
    """Replace the two methods on the engine's ZeRO 1/2 optimizer; False (nothing changed) for other wrappers."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    zero = engine.optimizer
    if type(zero) is not DeepSpeedZeroOptimizer or not _eligible(zero):
        return False
    zero.get_grad_norm_direct = types.MethodType(_grad_norm, zero)
    zero.unscale_and_clip_grads = types.MethodType(_unscale_and_clip, zero)
    return True
