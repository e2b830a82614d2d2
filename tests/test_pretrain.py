"""The pretrain stage end to end on CPU (2 workers, tiny BERT, local Ray): ZeRO 1/2/3 learn, a killed worker
and a rerun stage resume from the last checkpoint with bit-identical results, MLflow gets params/metrics/
artifacts, and bad input is refused before training."""
from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from bertpipe.jobs.pretrain.stage import run_stage
from bertpipe.jobs.pretrain.config import PhaseConfig
from bertpipe.pipeline.stage import StageInputError
from pretrain_helpers import SPECIALS, TOKENS, context, export_params, make_inputs, tiny_config

pytestmark = pytest.mark.integration

STEPS = 60


def base_config(**kw):
    return tiny_config(max_steps=STEPS, checkpoint_every_steps=20,
                       phases=(PhaseConfig(max_seq_length=32, max_predictions_per_seq=5, global_batch_size=32,
                                           micro_batch_size=8, learning_rate=3e-3, warmup_steps=6),), **kw)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrain_data")
    # 3,200 rows at seq 32 (100 steps of 32: no epoch restart in a 60-step run), a few at seq 64 for phase 2
    return root, make_inputs(root, lengths=(32, 64), rows_per_shard=800, num_shards=4, heldout_rows=160)


def baseline_accuracy(inputs, L=32) -> float:
    """Most-frequent-token baseline: share of the commonest non-special token in the held-out shard."""
    table = pq.read_table(Path(inputs["pairs"].uri) / f"seq{L}" / "heldout.parquet")
    counts = Counter(t for row in table.column("input_ids").to_pylist() for t in row if t >= len(SPECIALS))
    return max(counts.values()) / sum(counts.values())


@pytest.fixture(scope="module")
def straight(ray_local, data, tmp_path_factory):
    """ZeRO-1, 60 steps, tracked in MLflow: the reference run of the resume tests."""
    import mlflow
    from mlflow.tracking import MlflowClient

    _, inputs = data
    root = tmp_path_factory.mktemp("straight")
    uri = f"sqlite:///{root}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("pretrain-test", artifact_location=str(root / "artifacts"))
    run = client.create_run(exp)
    ctx = context(root, inputs, base_config(zero_stage=1),
                  tracking={"tracking_uri": uri, "run_id": run.info.run_id, "experiment_id": exp})
    result = run_stage(ctx)
    del mlflow
    return ctx, result, client, run.info.run_id


def test_zero1_learns_and_tracks_mlflow(straight, data):
    ctx, result, client, run_id = straight
    m = result.metrics
    assert m["step"] == STEPS
    initial = math.log(len(TOKENS)) + math.log(2)  # uniform MLM + NSP guesses
    assert m["loss"] < initial - 0.4, m
    assert m["eval_mlm_accuracy"] > baseline_accuracy(data[1]) + 0.05, m
    assert (Path(ctx.output_uri) / "metrics.json").is_file()
    assert sorted(p.name for p in (Path(ctx.output_uri) / "export").iterdir()) == [
        "config.json", "model.safetensors", "vocab.txt"]
    # MLflow: params, metric histories, DeepSpeed JSON and export artifacts
    run = client.get_run(run_id)
    assert run.data.params["pretrain.zero_stage"] == "1" and run.data.params["model.preset"] == "tiny"
    losses = client.get_metric_history(run_id, "loss")
    assert [x.step for x in losses] == [10, 20, 30, 40, 50, 60]
    assert losses[-1].value < losses[0].value
    for key in ("mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "lr", "grad_norm",
                "sequences_per_second", "tokens_per_second", "data_wait_fraction", "padding_fraction",
                "eval_mlm_accuracy"):
        assert client.get_metric_history(run_id, key), key
    # Synthetic rows are uniform in [19, 32] tokens. Random batches of 8 are padded to 32 almost always (~20%
    # padding); length binning lets the ~43% of rows up to 24 tokens share batches padded to 24 (~11%).
    assert all(0.0 < p.value < 0.15 for p in client.get_metric_history(run_id, "padding_fraction"))
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"deepspeed_config.json", "export"} <= artifacts
    assert {a.path for a in client.list_artifacts(run_id, "export")} >= {"export/model.safetensors"}
    # learning evidence: baselines, curves and their data beside the export, in the manifest and in MLflow
    learning = {"baselines.json", "history.json", "curve_loss.png", "curve_accuracy.png"}
    assert learning <= {p.name for p in Path(ctx.output_uri).iterdir()} and learning <= set(result.outputs)
    assert {a.path for a in client.list_artifacts(run_id, "learning")} == {f"learning/{n}" for n in learning}
    assert m["baseline_mlm_accuracy"] == pytest.approx(baseline_accuracy(data[1]), abs=0.03)
    assert m["eval_mlm_over_baseline"] == pytest.approx(m["eval_mlm_accuracy"] / m["baseline_mlm_accuracy"])
    assert 0.4 < m["baseline_nsp_accuracy"] < 0.6
    history = json.loads((Path(ctx.output_uri) / "history.json").read_text())
    assert [h["step"] for h in history if "loss" in h] == [10, 20, 30, 40, 50, 60]
    assert history[-1]["step"] == STEPS and history[-1]["eval_mlm_accuracy"] == m["eval_mlm_accuracy"]


def test_two_phases_zero2_learns_and_ends_at_phase2_length(ray_local, data, tmp_path):
    # ZeRO 1/2/3 learning on real shards is in test_pretrain_real.py; this one covers the phase switch:
    # 54 steps at seq 32, then 6 at seq 64 starting from phase 1's weights.
    _, inputs = data
    cfg = base_config(zero_stage=2)
    cfg = dataclasses.replace(cfg, phases=cfg.phases + (
        PhaseConfig(max_seq_length=64, max_predictions_per_seq=10, global_batch_size=16, micro_batch_size=4,
                    learning_rate=3e-3, warmup_steps=0),))
    result = run_stage(context(tmp_path, inputs, cfg))
    m = result.metrics
    assert m["step"] == STEPS
    assert m["loss"] < math.log(len(TOKENS)) + math.log(2) - 0.4, m
    assert m["seq_length"] == 64
    assert m["eval_mlm_accuracy"] > baseline_accuracy(inputs, 64) + 0.05, m


def test_killed_worker_resumes_from_last_checkpoint(straight, data, tmp_path, faults):
    """Rank 1 dies at step 30; the retry restarts from the step-20 checkpoint and ends bit-identical to the
    uninterrupted run."""
    _, inputs = data
    ctx = context(tmp_path, inputs, base_config(zero_stage=1, max_failures=1))
    faults.arm(step=30, rank=1)
    result = run_stage(ctx)
    assert faults.fired
    assert result.metrics["step"] == STEPS
    assert result.metrics["resumed_from_step"] == 20  # the retry began at the last checkpoint, not at 0
    reference = export_params(straight[0])
    got = export_params(ctx)
    assert reference.keys() == got.keys()
    assert all(torch.equal(reference[k], got[k]) for k in reference)


def test_rerun_stage_resumes(straight, data, tmp_path, faults):
    """No retries left: the stage fails at step 30; running the stage again continues from step 20
    (checkpoints live outside the output folder) and reproduces the straight run exactly."""
    import ray.train

    _, inputs = data
    cfg = base_config(zero_stage=1, max_failures=0)
    faults.arm(step=30, rank=1)
    with pytest.raises(ray.train.TrainingFailedError):
        run_stage(context(tmp_path, inputs, cfg))
    assert faults.fired
    ctx = context(tmp_path, inputs, cfg)
    result = run_stage(ctx)
    assert result.metrics["resumed_from_step"] == 20 and result.metrics["step"] == STEPS
    reference = export_params(straight[0])
    got = export_params(ctx)
    assert all(torch.equal(reference[k], got[k]) for k in reference)
    # the curves' data survive the resume (saved in the checkpoints) and the baselines are the same figures
    for name in ("history.json", "baselines.json"):
        assert (Path(ctx.output_uri) / name).read_text() == (Path(straight[0].output_uri) / name).read_text()


# ------------------------------------------------------------------ bad input, refused before training


def test_other_vocabulary_is_refused(ray_local, data, tmp_path):
    root, inputs = data
    other = make_inputs(tmp_path / "other", lengths=(32,), rows_per_shard=16, num_shards=2, heldout_rows=8,
                        vocab_tokens=TOKENS + ["extra"])
    mixed = {"pairs": inputs["pairs"], "vocab": other["vocab"]}
    with pytest.raises(StageInputError, match="built with vocabulary"):
        run_stage(context(tmp_path, mixed, base_config()))


def test_missing_seq_folder_is_refused(ray_local, data, tmp_path):
    _, inputs = data
    cfg = dataclasses.replace(base_config(), phases=base_config().phases + (
        PhaseConfig(max_seq_length=128, max_predictions_per_seq=20, global_batch_size=16, micro_batch_size=8),))
    with pytest.raises(StageInputError, match="max_seq_length=128"):
        run_stage(context(tmp_path, inputs, cfg))


def test_corrupt_shard_is_refused(ray_local, tmp_path):
    inputs = make_inputs(tmp_path, lengths=(32,), rows_per_shard=16, num_shards=2, heldout_rows=8)
    shard = Path(inputs["pairs"].uri) / "seq32" / "train-00001.parquet"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated upload
    with pytest.raises(StageInputError, match="train-00001.parquet"):
        run_stage(context(tmp_path, inputs, base_config()))


@pytest.mark.parametrize("overrides, message", [
    (dict(zero_stage=4), "zero_stage"),
    (dict(num_workers=3), "not divisible"),
    (dict(num_workers=2, cpus_per_worker=2), "at least 1 for data loading"),
    (dict(precision="bf16"), "needs use_gpu"),
    (dict(use_gpu=True), "GPUs"),
])
def test_impossible_configs_are_refused(ray_local, data, tmp_path, overrides, message):
    _, inputs = data
    with pytest.raises(ValueError, match=message):
        run_stage(context(tmp_path, inputs, base_config(**overrides)))


def test_diverging_run_stops_once_with_the_step_and_no_retry(ray_local, data, tmp_path):
    """A learning rate that blows the weights up: the run stops at the first logging window with one line naming
    the step, even with retries allowed (a retry would only meet the same NaN again)."""
    from bertpipe.jobs.pretrain.meter import NonFiniteError

    _, inputs = data
    cfg = tiny_config(max_steps=20, log_every_steps=5, checkpoint_every_steps=10**6, max_failures=3,
                      phases=(PhaseConfig(max_seq_length=32, max_predictions_per_seq=5, global_batch_size=32,
                                          micro_batch_size=8, learning_rate=1e30, warmup_steps=0),))
    with pytest.raises(NonFiniteError) as err:
        run_stage(context(tmp_path, inputs, cfg))
    message = str(err.value)
    assert "\n" not in message and message.startswith("pretrain (seq 32): the loss")
    assert "not finite at optimizer step" in message and int(message.split("step ")[1].split(":")[0]) <= 5
    assert not (Path(tmp_path) / "pretrain" / "export").exists()
