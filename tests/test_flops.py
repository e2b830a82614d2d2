"""The useful-FLOP count behind the logged model TFLOP/s and utilisation (model/flops.py), against torch's own
FlopCounterMode on a real forward + backward, and the meter's arithmetic with it."""
from __future__ import annotations

import types

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bertpipe.jobs.pretrain.metrics import meter as meter_module
from bertpipe.jobs.pretrain.metrics.meter import Meter
from bertpipe.model import BertConfig, BertForPreTraining
from bertpipe.model.flops import peak_tflops, step_flops


@pytest.mark.parametrize("preset,batch,seq,masked", [("tiny", 4, 32, 5), ("mini", 3, 64, 10)])
def test_step_flops_equal_what_torch_counts_in_a_forward_and_backward(preset, batch, seq, masked):
    config = BertConfig.preset(preset, vocab_size=4096, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForPreTraining(config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 4096, (batch, seq), generator=g)
    tt, am = torch.zeros_like(ids), torch.ones_like(ids)
    positions = torch.randint(1, seq, (batch, masked), generator=g)
    labels = torch.randint(5, 4096, (batch, masked), generator=g)
    nsp = torch.randint(0, 2, (batch,), generator=g)
    # Attention through the math kernel: its two batched matmuls are then ops torch's counter sees.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids, tt, am, positions, labels, nsp).loss.backward()
    # Embedding lookups, layer norms, GELU and the loss are no matmuls: torch counts exactly what we count.
    assert step_flops(config, batch, seq, masked) == pytest.approx(counter.get_total_flops(), rel=1e-9)


def test_bert_large_at_seq_128_is_the_figure_the_gpu_benchmarks_use():
    config = BertConfig.preset("large", vocab_size=30_522)
    per_sequence = step_flops(config, 1, 128, 20)
    assert 0.235e12 < per_sequence < 0.245e12  # ~0.24 TFLOP: 6 · 302M encoder weights · 128 tokens + heads
    assert step_flops(config, 8, 128, 20) == pytest.approx(8 * per_sequence)


def test_peak_from_the_card_name():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-40GB") == 312.0
    assert peak_tflops("NVIDIA GH200 480GB") == 989.0
    assert peak_tflops("cpu") is None and peak_tflops("Some Future Card") is None


class FakeOut:
    """A model output of fixed figures (the meter reads only these tensors)."""

    def __init__(self):
        self.loss = self.mlm_loss = self.nsp_loss = torch.tensor(1.0)
        self.mlm_correct, self.mlm_count, self.nsp_correct = torch.tensor(3), torch.tensor(6), torch.tensor(2)


def test_meter_turns_batch_shapes_into_model_tflops_and_utilisation(monkeypatch, tmp_path):
    import torch.distributed as dist

    import engine_helpers as eh

    with eh.process_group():
        clock = types.SimpleNamespace(now=100.0)  # the meter's own clock, not the process's
        monkeypatch.setattr(meter_module, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
        meter = Meter(flops_of=lambda batch, seq: 1e12 * batch * seq, peak_tflops=400.0)
        for _ in range(3):
            meter.add(FakeOut(), torch.ones(4, 8, dtype=torch.int64), 0.0)
        clock.now = 102.0  # the window: 2 s
        s = meter.summary(dist.get_world_size())
    # 3 micro-batches × 4 × 8 × 1e12 FLOPs in 2 s on one device: 48 TFLOP/s, 12% of 400
    assert s["model_tflops_per_second"] == pytest.approx(48.0)
    assert s["model_flops_utilization"] == pytest.approx(0.12)
    no_peak = Meter(flops_of=lambda batch, seq: 1.0)
    assert "model_flops_utilization" not in no_peak._flop_figures(5e12)
    assert no_peak._flop_figures(5e12) == {"model_tflops_per_second": 5.0}
    assert Meter()._flop_figures(5e12) == {}
