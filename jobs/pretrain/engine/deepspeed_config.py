"""The DeepSpeed JSON, generated from the typed PretrainConfig (never hand-kept), and logged with every run.

The optimizer and the learning-rate schedule are normally *not* in the JSON: we hand DeepSpeed a torch
optimizer (torch AdamW, or our LAMB) and a torch LambdaLR, so nothing needs compiling on CPU. Only
`optimizer_impl: deepspeed` (GPU) puts an "optimizer" section in, which DeepSpeed turns into its fused
Adam/LAMB — the path optimizer offload needs (DeepSpeedCPUAdam).
"""
from __future__ import annotations

from typing import Any

from bertpipe.jobs.pretrain.config import PhaseConfig, PretrainConfig


def resolved_precision(cfg: PretrainConfig) -> str:
    if not cfg.use_gpu:
        return "fp32"  # DeepSpeed's CPU accelerator and gloo: fp32 only (PretrainConfig refuses bf16/fp16 on CPU)
    return "bf16" if cfg.precision == "auto" else cfg.precision


def deepspeed_config(cfg: PretrainConfig, phase: PhaseConfig, world_size: int) -> dict[str, Any]:
    """The config passed to deepspeed.initialize for `phase` (the batch sizes are per phase; the rest is not)."""
    if phase.global_batch_size % (phase.micro_batch_size * world_size):
        raise ValueError(f"global_batch_size {phase.global_batch_size} is not divisible by micro_batch_size "
                         f"{phase.micro_batch_size} × {world_size} workers")
    precision = resolved_precision(cfg)
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    if cfg.zero_stage >= 1:
        # Overlap the gradient reduce with the backward pass; buckets of 50M elements (DeepSpeed's default is
        # 500M, too much host memory for small CPU workers, no measurable gain at BERT-Large sizes).
        zero.update(overlap_comm=cfg.use_gpu, contiguous_gradients=True,
                    reduce_bucket_size=50_000_000, allgather_bucket_size=50_000_000)
    if cfg.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=False)
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    ds: dict[str, Any] = {
        "train_batch_size": phase.global_batch_size,
        "train_micro_batch_size_per_gpu": phase.micro_batch_size,
        "gradient_accumulation_steps": phase.accumulation(world_size),
        "gradient_clipping": cfg.gradient_clipping,
        "zero_optimization": zero,
        # bf16 has no loss scale, so nothing to skip a step for: DeepSpeed's per-gradient overflow check only
        # costs ~10 small kernels per gradient and a host wait per step (a third of the step on an H100). The loop
        # checks the loss and the global gradient norm on the device instead (meter.Meter.end_step).
        "bf16": {"enabled": True, "check_grad_overflow": False} if precision == "bf16" else {"enabled": False},
        # Dynamic loss scaling (loss_scale 0), start at 2^16 as NVIDIA's BERT recipe does.
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        # Our torch optimizers are not on DeepSpeed's ZeRO whitelist, but ZeRO 1-3 only need a torch Optimizer.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,  # we log ourselves (MLflow), DeepSpeed's prints would only add noise
        "wall_clock_breakdown": False,
    }
    if cfg.optimizer_impl == "deepspeed":
        params = {"lr": 1.0, "betas": [cfg.beta1, cfg.beta2], "eps": cfg.eps, "weight_decay": cfg.weight_decay}
        # lr 1.0: the LambdaLR we pass returns the absolute learning rate (see pretrain_optim.lr_lambda).
        ds["optimizer"] = {"type": "AdamW" if cfg.optimizer == "adamw" else "Lamb", "params": params}
    return ds
