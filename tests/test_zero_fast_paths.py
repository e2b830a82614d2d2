"""jobs/pretrain/engine/zero_fast_paths.py against DeepSpeed's own methods: the same global gradient norms, the same
clipping and so the same weights, step for step, under ZeRO 1 and 2 in fp32 and bf16 (CPU, one rank, no Ray)."""
from __future__ import annotations

import pytest
import torch

import engine_helpers as eh
from bertpipe.jobs.pretrain import loop, worker
from bertpipe.jobs.pretrain.config import PhaseConfig, PretrainConfig
from bertpipe.jobs.pretrain.data.masking import batch_rng, mask_batch


def run(cfg, precision, fast: bool, steps=4):
    w = eh.worker(cfg, precision=precision)
    zero = w.engine.optimizer
    installed = "get_grad_norm_direct" in zero.__dict__ and "unscale_and_clip_grads" in zero.__dict__
    if not fast:  # drop the instance methods: DeepSpeed's class methods answer again
        del zero.get_grad_norm_direct, zero.unscale_and_clip_grads
    spec, norms = worker.masking_spec(w, cfg.phases[0]), []
    for i, raw in enumerate(eh.raw_batches(steps, 8, 32)):
        batch = worker.to_device(mask_batch(raw, spec, batch_rng(1, 0, 0, 0, i)), w.device)
        loop.train_step(w, batch, 1000 + i)
        norms.append(float(w.engine.get_global_grad_norm()))
    weights = {k: p.detach().float().clone() for k, p in w.engine.module.named_parameters()}
    return installed, norms, weights


@pytest.mark.parametrize("zero_stage, precision, clip", [(1, "fp32", 1.0), (2, "fp32", 0.05), (1, "bf16", 0.05),
                                                         (2, "bf16", 1.0)])
def test_same_norms_and_weights_as_deepspeed(zero_stage, precision, clip):
    cfg = PretrainConfig(num_workers=1, zero_stage=zero_stage, gradient_clipping=clip, max_steps=4,
                         phases=(PhaseConfig(max_seq_length=32, max_predictions_per_seq=5, global_batch_size=8,
                                             micro_batch_size=8, learning_rate=1e-2, warmup_steps=0),))
    with eh.process_group():
        installed, fast_norms, fast_weights = run(cfg, precision, fast=True)
        _, ds_norms, ds_weights = run(cfg, precision, fast=False)
    assert installed
    assert fast_norms == pytest.approx(ds_norms, rel=1e-6)
    if clip == 0.05:
        assert min(ds_norms) > clip  # clipping was in effect on every step
    for name, w in ds_weights.items():
        torch.testing.assert_close(fast_weights[name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_not_installed_where_deepspeed_does_something_else():
    """ZeRO 0 has no DeepSpeedZeroOptimizer: nothing is replaced."""
    cfg = PretrainConfig(num_workers=1, zero_stage=0, max_steps=2,
                         phases=(PhaseConfig(max_seq_length=32, max_predictions_per_seq=5, global_batch_size=8,
                                             micro_batch_size=8),))
    with eh.process_group():
        w = eh.worker(cfg)
    assert "get_grad_norm_direct" not in vars(w.engine.optimizer)
