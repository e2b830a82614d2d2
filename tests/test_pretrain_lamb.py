"""The LAMB pre-training path end to end on CPU (2 workers, local Ray): the bert_large_lamb preset, shrunk by --set
overrides only, learns under ZeRO 2; and a killed run resumes that run's LAMB state from a checkpoint bit-exactly,
both in Ray Train's retry and in a rerun of the failed stage. The one ZeRO 2 pre-training of the default suite
(ZeRO 1 and 3: tests/test_pretrain.py)."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from bertpipe.jobs.config import load_config
from bertpipe.jobs.pretrain.stage import run_stage
from pretrain_helpers import TOKENS, context, export_params, make_inputs

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("lamb_data")
    return root, make_inputs(root, lengths=(32, 64), rows_per_shard=400, num_shards=4, heldout_rows=64)


# bert_large_lamb's optimizer, ZeRO stage and schedule shape (poly 0.5 per phase, ~28%/13% warmup). The peak lrs
# are ×25/3 (the preset's 6:4 ratio kept): LAMB moves each matrix by lr × its norm per step, and at the preset's
# 6e-3 (tuned for batch 64k) 20 steps left the tiny model at loss 4.52 against 4.56 for uniform guessing.
# A checkpoint at step 10, in phase 1 (none at the last step): the resume test below restarts from it.
SHRINK = [
    "model.preset=tiny", "pretrain.num_workers=2", "pretrain.cpus_per_worker=1", "pretrain.use_gpu=false",
    "pretrain.precision=fp32",  # needed: the config refuses bf16 without a GPU (DeepSpeed's CPU path is fp32)
    "pretrain.max_steps=20", "pretrain.log_every_steps=5", "pretrain.eval_max_batches=2",
    "pretrain.checkpoint_every_steps=10",
    "pretrain.phases=[{max_seq_length: 32, max_predictions_per_seq: 5, global_batch_size: 32, micro_batch_size: 8,"
    " learning_rate: 5.0e-2, warmup_steps: 5}, {max_seq_length: 64, max_predictions_per_seq: 10,"
    " global_batch_size: 16, micro_batch_size: 4, learning_rate: 3.33e-2, warmup_steps: 1}]",
]
# The preset runs ZeRO 1; ZeRO 1 and 2 take exactly the same LAMB steps (tests/test_lamb_deepspeed.py), and ZeRO 2
# partitions the gradients as well: the stage, its checkpoints and the resume under it are tested here.
ZERO2 = ["pretrain.zero_stage=2"]


@pytest.fixture(scope="module")
def preset_run(ray_local, data, tmp_path_factory):
    """The shrunk preset trained once, tracked in MLflow: the learning test's run and the resume test's reference."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("lamb_preset")
    cfg = load_config("bert_large_lamb", SHRINK + ZERO2)
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    exp = client.create_experiment("lamb", artifact_location=str(root / "artifacts"))
    run = client.create_run(exp)
    ctx = context(root, data[1], cfg.pretrain, model=cfg.model,
                  tracking={"tracking_uri": client.tracking_uri, "run_id": run.info.run_id})
    return cfg, ctx, run_stage(ctx), client, run.info.run_id


def test_bert_large_lamb_preset_shrunk_by_overrides_learns(preset_run):
    cfg, _, result, client, run_id = preset_run
    p = load_config("bert_large_lamb", SHRINK).pretrain
    assert (p.optimizer, p.zero_stage, p.lr_schedule, p.decay_power) == ("lamb", 1, "phase", 0.5)
    assert p.phase_steps() == (16, 4)  # the preset's phase1_fraction 0.8183
    assert cfg.pretrain == dataclasses.replace(p, zero_stage=2)
    m = result.metrics
    assert m["step"] == 20 and m["seq_length"] == 64 and m["lamb_layouts"] == 2
    loss = {h.step: h.value for h in client.get_metric_history(run_id, "train/loss")}
    assert loss[16] < loss[5] - 0.1, loss  # phase 1 (seq 32): the loss falls
    assert m["loss"] < math.log(len(TOKENS)) + math.log(2), m  # and ends below uniform MLM + NSP guessing


def test_lamb_retries_then_reruns_bit_exactly_from_a_checkpoint(preset_run, data, tmp_path, faults):
    """The preset's LAMB run (ZeRO 2, its per-phase schedule) killed twice, with one retry allowed. Rank 0 dies at
    step 17, the first step of phase 2: Ray Train's retry loads the step-10 checkpoint of phase 1 (the AdamW runs'
    resume restarts at 20). Rank 1 dies again at step 19, in the retry: no retry is left and the stage fails. The
    stage run again (a user's rerun) continues from that checkpoint, kept in the run folder outside the stage's
    output: moments, step counts, the per-phase schedule and the trust-ratio layouts restored, the phase switch
    crossed again, and the end is bit-identical to the run never killed, its learning curves' data too."""
    import ray.train

    cfg, straight, _, _, _ = preset_run
    pretrain = dataclasses.replace(cfg.pretrain, max_failures=1)
    faults.arm(step=17, rank=0, then=(19, 1))
    with pytest.raises(ray.train.TrainingFailedError) as failed:
        run_stage(context(tmp_path, data[1], pretrain, model=cfg.model))
    # the retry began at 10 (if it failed otherwise, Ray Train's error says how)
    assert [(k["step"], k["started_at"]) for k in faults.kills] == [(17, 0), (19, 10)], str(failed.value)[-3000:]
    ctx = context(tmp_path, data[1], pretrain, model=cfg.model)
    result = run_stage(ctx)
    assert result.metrics["resumed_from_step"] == 10 and result.metrics["step"] == 20
    assert result.metrics["lamb_layouts"] == 2  # the resumed worker's LAMB is still per layer
    reference, got = export_params(straight), export_params(ctx)
    assert reference.keys() == got.keys()
    assert all(torch.equal(reference[k], got[k]) for k in reference)
    # the curves' data survive the resume (saved in the checkpoints) and the baselines are the same figures
    for name in ("history.json", "baselines.json"):
        assert (Path(ctx.output_uri) / name).read_text() == (Path(straight.output_uri) / name).read_text()
