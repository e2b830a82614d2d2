"""Our LAMB without DeepSpeed: one trust ratio per parameter also when the parameters come as one flat tensor
(what DeepSpeed hands the optimizer under ZeRO 1/2 and bf16), and the combinations that cannot be layer-wise are
refused at config load."""
from __future__ import annotations

import pytest
import torch

from bertpipe.jobs.pretrain.config import PretrainConfig
from bertpipe.jobs.pretrain.engine.optim import FlatLayout, Lamb

LR = 0.1


def test_flat_tensor_gets_each_parameters_own_ratio():
    """Two matrices of very different norms in one flat tensor (with a padding gap between them, as DeepSpeed
    aligns parameters): after one step each moves by lr × its own norm, not by a share of the flat norm."""
    torch.manual_seed(0)
    small, big = torch.randn(6, 5) * 0.01, torch.randn(4, 8) * 10.0
    flat = torch.nn.Parameter(torch.cat([small.flatten(), torch.zeros(2), big.flatten()]))
    layout = FlatLayout(segments=((0, 0, 30), (1, 32, 64)), num_params=2)
    opt = Lamb([{"params": [flat], "weight_decay": 0.01}], lr=LR)
    opt.set_layout(flat, layout)
    flat.grad = torch.randn(64)
    before = flat.detach().clone()
    opt.step()
    delta = flat.detach() - before
    # first step: m̂/√v̂ = sign(g), so ‖update‖ ≈ √n while ‖w‖ differs by 1000×: only a per-matrix ratio gives these
    assert delta[:30].norm().item() == pytest.approx(LR * small.norm().item(), rel=1e-4)
    assert delta[32:].norm().item() == pytest.approx(LR * big.norm().item(), rel=1e-4)
    assert torch.equal(delta[30:32], torch.zeros(2))  # padding stays untouched


def test_flat_step_equals_per_tensor_step():
    torch.manual_seed(1)
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5) * 4)
    flat = torch.nn.Parameter(torch.cat([a.detach().flatten(), b.detach()]))
    per_tensor = Lamb([{"params": [a, b], "weight_decay": 0.01}], lr=LR)
    flat_opt = Lamb([{"params": [flat], "weight_decay": 0.01}], lr=LR)
    flat_opt.set_layout(flat, FlatLayout(segments=((0, 0, 12), (1, 12, 17)), num_params=2))
    for _ in range(3):
        g = torch.randn(17)
        a.grad, b.grad, flat.grad = g[:12].view(3, 4).clone(), g[12:].clone(), g.clone()
        per_tensor.step()
        flat_opt.step()
    assert torch.allclose(flat.detach(), torch.cat([a.detach().flatten(), b.detach()]), rtol=0, atol=1e-6)


def test_gpu_and_cpu_ways_of_applying_the_ratios_agree():
    """The scale-tensor path (taken on CUDA) and the in-place views path (CPU) move every segment alike and leave
    the alignment gaps alone."""
    from bertpipe.jobs.pretrain.engine.optim import Pieces, _apply_scale_tensor, _apply_views

    torch.manual_seed(2)
    layout = FlatLayout(segments=((1, 3, 20), (0, 24, 60), (2, 60, 61)), num_params=3)
    pieces = Pieces.of(layout, 70, "cpu")
    assert pieces.sizes == (3, 17, 4, 36, 1, 9) and pieces.held == (1, 3, 4)
    p, update, factors = torch.randn(70), torch.randn(70), torch.tensor([0.5, -2.0, 3.0])
    by_scale, by_views = p.clone(), p.clone()
    _apply_scale_tensor(by_scale, update.clone(), pieces, factors)
    _apply_views(by_views, update.clone(), pieces, factors)
    torch.testing.assert_close(by_scale, by_views)
    torch.testing.assert_close(by_views[3:20], p[3:20] + 0.5 * update[3:20])
    assert torch.equal(by_views[:3], p[:3]) and torch.equal(by_views[20:24], p[20:24])


def test_flat_tensor_without_layout_is_an_error_once_layouts_are_set():
    x, y = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = Lamb([{"params": [x, y], "weight_decay": 0.01}], lr=LR)
    opt.set_layout(x, FlatLayout(segments=((0, 0, 4),), num_params=1))
    x.grad, y.grad = torch.ones(4), torch.ones(4)
    with pytest.raises(RuntimeError, match="no layout"):
        opt.step()


@pytest.mark.parametrize("overrides, message", [
    (dict(zero_stage=3), r"optimizer lamb with zero_stage 3 .* use zero_stage 1 or 2"),
    (dict(optimizer_impl="deepspeed", use_gpu=True), r"optimizer lamb with optimizer_impl 'deepspeed' .* "
                                                     r"use optimizer_impl 'torch'"),
    (dict(offload_optimizer=True, use_gpu=True, optimizer_impl="torch"), "offload_optimizer needs .*adamw"),
])
def test_lamb_combinations_that_cannot_be_layer_wise_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        PretrainConfig(optimizer="lamb", **overrides)
    PretrainConfig(optimizer="adamw", **{k: v for k, v in overrides.items() if k != "offload_optimizer"})


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_lamb_accepted_at_zero_0_1_2(zero_stage):
    PretrainConfig(optimizer="lamb", zero_stage=zero_stage)
    PretrainConfig(optimizer="lamb", zero_stage=zero_stage, use_gpu=True, precision="bf16")
