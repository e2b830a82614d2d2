"""The generated DeepSpeed JSON, config validation, the learning-rate schedule and our LAMB (no Ray)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from bertpipe.jobs.pretrain.engine.deepspeed_config import deepspeed_config
from bertpipe.jobs.pretrain.config import PhaseConfig, PretrainConfig
from bertpipe.jobs.pretrain.engine.optim import Lamb, LrSchedule
from bertpipe.model.training import param_groups


def test_json_per_zero_stage_and_accumulation():
    for stage in (0, 1, 2, 3):
        phase = PhaseConfig(global_batch_size=96, micro_batch_size=4)
        cfg = PretrainConfig(zero_stage=stage, num_workers=3, phases=(phase,))
        ds = deepspeed_config(cfg, phase, world_size=3)
        assert ds["zero_optimization"]["stage"] == stage
        assert ds["train_batch_size"] == 96 and ds["train_micro_batch_size_per_gpu"] == 4
        assert ds["gradient_accumulation_steps"] == 8  # 96 / (4 × 3)
        assert ds["gradient_clipping"] == 1.0
        assert not ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]  # CPU: fp32
        assert "optimizer" not in ds  # torch optimizer handed in


def test_gpu_precision_and_offload():
    cfg = PretrainConfig(use_gpu=True, zero_stage=2, offload_optimizer=True, optimizer_impl="deepspeed",
                         num_workers=8, phases=(PhaseConfig(global_batch_size=256, micro_batch_size=32),))
    ds = deepspeed_config(cfg, PhaseConfig(global_batch_size=256, micro_batch_size=32), 8)
    assert ds["bf16"]["enabled"] and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["weight_decay"] == 0.01
    fp16 = deepspeed_config(dataclasses.replace(cfg, precision="fp16"), PhaseConfig(global_batch_size=256,
                                                                                      micro_batch_size=32), 8)
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0 and not fp16["bf16"]["enabled"]


@pytest.mark.parametrize("overrides, message", [
    (dict(zero_stage=-1), "zero_stage"),
    (dict(offload_optimizer=True), "offload_optimizer"),
    (dict(optimizer_impl="deepspeed"), "needs compiled ops"),
    (dict(num_workers=3), "not divisible by num_workers"),
    (dict(max_steps=0), "max_steps"),
    (dict(phase1_fraction=0.0), "phase1_fraction"),
    (dict(phases=(dict(max_seq_length=512), dict(max_seq_length=128))), "must grow"),
    (dict(phases=(dict(max_seq_length=1024),)), r"\[8, 512\]"),
    (dict(phases=(dict(max_predictions_per_seq=0),)), "max_predictions_per_seq"),
    (dict(length_bin_window=0), "length_bin_window"),
])
def test_impossible_configs(overrides, message):
    """Refused when built (a phase checks its own fields, the section the combinations); phases are given as
    keyword dicts so that building them happens inside the test."""
    with pytest.raises(ValueError, match=message):
        phases = tuple(PhaseConfig(**p) for p in overrides.get("phases", ()))
        PretrainConfig(**{**overrides, "phases": phases} if phases else overrides)


def test_phase_steps_split_ninety_ten():
    assert PretrainConfig(max_steps=1_000_000).phase_steps() == (900_000, 100_000)
    assert PretrainConfig(max_steps=37, phases=(PhaseConfig(),)).phase_steps() == (37,)


def test_paper_schedule_runs_over_both_phases():
    cfg = PretrainConfig(max_steps=1000, phases=(PhaseConfig(learning_rate=1e-4, warmup_steps=100),
                                                 PhaseConfig(max_seq_length=512, learning_rate=5.0)))
    lr = LrSchedule(cfg)
    assert lr(0) == pytest.approx(1e-6) and lr(99) == pytest.approx(1e-4)
    assert lr(550) == pytest.approx(0.5e-4)
    assert lr(900) == pytest.approx(1e-4 * 100 / 900)  # phase 2 continues the decay; its lr is ignored
    assert lr(1000) == 0.0


def test_per_phase_schedule_restarts_with_poly_decay():
    cfg = PretrainConfig(max_steps=100, lr_schedule="phase", decay_power=0.5,
                         phases=(PhaseConfig(learning_rate=6e-3, warmup_steps=10),
                                 PhaseConfig(max_seq_length=512, learning_rate=4e-3, warmup_steps=5)))
    lr = LrSchedule(cfg)
    assert lr(9) == pytest.approx(6e-3)
    assert lr(50) == pytest.approx(6e-3 * (40 / 80) ** 0.5)
    assert lr(90) == pytest.approx(4e-3 / 5) and lr(94) == pytest.approx(4e-3)
    assert lr(97) == pytest.approx(4e-3 * (3 / 5) ** 0.5)


def test_no_weight_decay_on_bias_and_layernorm():
    model = torch.nn.Sequential(torch.nn.Embedding(7, 5), torch.nn.Linear(5, 3), torch.nn.LayerNorm(3))
    decay, no_decay = param_groups(model, 0.01)
    assert {p.shape for p in decay["params"]} == {torch.Size([7, 5]), torch.Size([3, 5])}
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0


def test_lamb_trust_ratio_scales_update_to_weight_norm():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(13, 7) * 3)
    b = torch.nn.Parameter(torch.zeros(7))
    opt = Lamb([{"params": [w], "weight_decay": 0.01}, {"params": [b], "weight_decay": 0.0}], lr=0.1)
    w0, b0 = w.detach().clone(), b.detach().clone()
    w.grad = torch.randn(13, 7) * 1e-3
    b.grad = torch.ones(7)
    opt.step()
    # layer-wise: ‖Δw‖ = lr × ‖w‖ whatever the gradient scale (first step: m̂/√v̂ = sign(g))
    assert (w - w0).norm().item() == pytest.approx(0.1 * w0.norm().item(), rel=1e-4)
    # no weight decay → no trust ratio: plain Adam step of lr per coordinate
    assert torch.allclose(b - b0, torch.full((7,), -0.1), atol=1e-5)
