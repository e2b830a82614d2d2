"""The pre-training stack on a real GPU (skipped without CUDA): Ray Train + DeepSpeed bf16 ZeRO 1 with the GPU
defaults (no per-gradient overflow check, engine.compile()), AdamW and LAMB (whose layout check all-reduces over
NCCL), 10 steps on learnable shards; the loss falls, the utilisation is logged and the export loads in
transformers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bertpipe.jobs.pretrain.config import ModelConfig, PhaseConfig
from pretrain_helpers import context, make_inputs, tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.integration,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_ten_gpu_steps_learn_and_export_loads_in_transformers(ray_local, tmp_path, optimizer):
    import transformers

    from bertpipe.jobs.pretrain.stage import run_stage

    inputs = make_inputs(tmp_path, lengths=(32,), rows_per_shard=800, num_shards=2, heldout_rows=160)
    cfg = tiny_config(num_workers=1, use_gpu=True, precision="bf16", optimizer=optimizer, max_steps=10,
                      log_every_steps=2, checkpoint_every_steps=10**6, eval_every_steps=0,
                      phases=(PhaseConfig(max_seq_length=32, max_predictions_per_seq=5, global_batch_size=64,
                                          micro_batch_size=64, learning_rate=3e-3, warmup_steps=2),))
    ctx = context(tmp_path, inputs, cfg, model=ModelConfig(preset="mini"))
    result = run_stage(ctx)
    history = json.loads((Path(ctx.output_uri) / "history.json").read_text())
    losses = [row["loss"] for row in history if "loss" in row]
    assert result.metrics["step"] == 10 and len(losses) >= 4
    # the card's utilisation is logged beside sequences/s (an H100 or any card of model/flops.py's table)
    assert 0.0 < result.metrics["model_flops_utilization"] < 1.0, result.metrics
    assert losses[-1] < losses[0] - 0.3, losses
    model, info = transformers.BertForPreTraining.from_pretrained(Path(ctx.output_uri) / "export",
                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.tensor([[2, 10, 11, 3, 20, 21, 3]])
    assert torch.isfinite(model(input_ids=ids).prediction_logits).all()
