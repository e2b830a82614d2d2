"""The pretrain stage end to end on CPU (2 workers, tiny BERT, local Ray): ZeRO 1/2/3 learn and take the same
steps through a phase switch, MLflow gets params/metrics/artifacts, and bad input is refused before training. (The
resume from a checkpoint, bit-identical, in the default suite: tests/test_pretrain_lamb.py; the AdamW resumes here
are `slow`.)"""
from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bertpipe.jobs.pretrain.checkpointing.export_card import CARD_FILES
from bertpipe.jobs.pretrain.checkpointing.export import EXPORT_FILES
from bertpipe.jobs.pretrain.stage import run_stage
from bertpipe.jobs.pretrain.config import ModelConfig, PhaseConfig
from bertpipe.pipeline.framework.stage import StageInputError
from pretrain_helpers import SPECIALS, TOKENS, context, make_inputs, tiny_config

pytestmark = pytest.mark.integration

STEPS = 60


def base_config(**kw):
    kw.setdefault("checkpoint_every_steps", 20)
    return tiny_config(max_steps=STEPS,
                       phases=(PhaseConfig(max_seq_length=32, max_predictions_per_seq=5, global_batch_size=32,
                                           micro_batch_size=8, learning_rate=3e-3, warmup_steps=6),), **kw)


def loss_history(ctx) -> dict[int, float]:
    """{step: training loss of the logging window ending there}, from the stage's history.json."""
    history = json.loads((Path(ctx.output_uri) / "history.json").read_text())
    return {h["step"]: h["loss"] for h in history if "loss" in h}


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
    assert sorted(p.name for p in (Path(ctx.output_uri) / "export").iterdir()) == sorted(EXPORT_FILES + CARD_FILES)
    # MLflow: params, metric histories, DeepSpeed JSON and export artifacts
    run = client.get_run(run_id)
    assert run.data.params["pretrain.zero_stage"] == "1" and run.data.params["model.preset"] == "tiny"
    losses = client.get_metric_history(run_id, "train/loss")
    assert [x.step for x in losses] == [10, 20, 30, 40, 50, 60]
    assert losses[-1].value < losses[0].value
    for key in ("train/mlm_loss", "train/nsp_loss", "train/mlm_accuracy", "train/nsp_accuracy", "train/optimizer/lr",
                "train/optimizer/grad_norm", "train/throughput/padding_fraction", "eval/mlm_accuracy"):
        assert [x.step for x in client.get_metric_history(run_id, key)][-1] == STEPS, key
    for key in ("sequences_per_second", "tokens_per_second", "data_wait_fraction"):  # not the start-up window
        assert [x.step for x in client.get_metric_history(run_id, f"train/throughput/{key}")] == [20, 30, 40, 50, 60]
    # One value each, at step 0 (bars in MLflow's UI): the stage's summary, not a one-point series.
    summary = {k: v for k, v in run.data.metrics.items() if "/" not in k}
    assert {"baseline_mlm_accuracy", "eval_mlm_over_baseline", "heldout_sequences"} <= set(summary), summary
    assert all(client.get_metric_history(run_id, k)[-1].step == 0 for k in summary), summary
    # Synthetic rows are uniform in [19, 32] tokens. Random batches of 8 are padded to 32 almost always (~20%
    # padding); length binning lets the ~43% of rows up to 24 tokens share batches padded to 24 (~11%).
    assert all(0.0 < p.value < 0.15 for p in client.get_metric_history(run_id, "train/throughput/padding_fraction"))
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


def assert_same_training(got: dict[int, float], reference: dict[int, float]) -> None:
    """ZeRO partitions optimizer state, gradients (2) and parameters (3) across ranks; it must not change the math:
    from the same seed the same window losses (fp32 on CPU: only the order of the sums differs)."""
    common = sorted(set(got) & set(reference))
    assert len(common) >= 5, (got, reference)
    for step in common:
        assert got[step] == pytest.approx(reference[step], abs=0.02), (step, got, reference)


def test_two_phases_zero3_learns_and_ends_at_phase2_length(straight, ray_local, data, tmp_path):
    """ZeRO 3 (parameters partitioned too: gathered for each forward, the evaluation and the export) through the
    phase switch: 54 steps at seq 32, then 6 at seq 64 starting from phase 1's weights. Phase 1 is the straight
    run's recipe (the "run" schedule reads only phase 1's rate), so its losses are ZeRO 1's. One checkpoint (every
    rank's partition), at step 30 and at the end, are complete. (ZeRO 2: tests/test_pretrain_lamb.py.)"""
    from mlflow.tracking import MlflowClient

    from bertpipe.jobs.pretrain.checkpointing.folders import STATE_FILE, latest_checkpoint

    _, inputs = data
    cfg = base_config(zero_stage=3, checkpoint_every_steps=30)
    cfg = dataclasses.replace(cfg, phases=cfg.phases + (
        PhaseConfig(max_seq_length=64, max_predictions_per_seq=10, global_batch_size=16, micro_batch_size=4,
                    learning_rate=3e-3, warmup_steps=0),))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.create_experiment("phases", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(exp).info.run_id
    ctx = context(tmp_path, inputs, cfg, tracking={"tracking_uri": client.tracking_uri, "run_id": run_id,
                                                   "experiment_id": exp})
    result = run_stage(ctx)
    m = result.metrics
    assert m["step"] == STEPS
    assert m["loss"] < math.log(len(TOKENS)) + math.log(2) - 0.4, m
    assert m["seq_length"] == 64
    assert m["eval_mlm_accuracy"] > baseline_accuracy(inputs, 64) + 0.05, m
    assert sorted(p.name for p in (Path(ctx.output_uri) / "export").iterdir()) == sorted(EXPORT_FILES + CARD_FILES)
    run_dir = Path(result.extra["checkpoints"])
    ckpt = latest_checkpoint(str(run_dir.parent), run_dir.name, cfg)
    assert ckpt and json.loads((Path(ckpt) / STATE_FILE).read_text())["step"] == STEPS, ckpt
    # Both kept checkpoints (step 30 and the last) hold every rank's partition of the optimizer state.
    saved = {json.loads((d / STATE_FILE).read_text())["step"]: d
             for d in run_dir.glob("checkpoint_*") if d.is_dir()}
    assert sorted(saved) == [30, STEPS], saved
    for d in saved.values():
        assert sorted(p.name for p in d.rglob("zero_pp_rank_*_optim_states.pt")) == [
            f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(cfg.num_workers)], d
    phase1 = cfg.phase_steps()[0]
    assert_same_training({s: v for s, v in loss_history(ctx).items() if s <= phase1}, loss_history(straight[0]))
    # Windows end at 10 ... 50, 54 (phase 1's end) and 60. The first (start-up) and the one that opens seq 64
    # (60) log no speed in MLflow: the speed ends on phase 1's last steady window, not on the switch.
    assert [x.step for x in client.get_metric_history(run_id, "train/loss")] == [10, 20, 30, 40, 50, 54, 60]
    for key in ("sequences_per_second", "data_wait_fraction"):
        assert [x.step for x in client.get_metric_history(run_id, f"train/throughput/{key}")] == [20, 30, 40, 50, 54]
    assert [x.value for x in client.get_metric_history(run_id, "train/seq_length")][-2:] == [32, 64]


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


# Slow (~26 s, a Ray Train run of its own): the detection itself, at the logging window and naming the step, is
# tests/test_step_path.py::test_non_finite_stops_at_the_window_naming_the_step; this adds that Ray Train does not retry.
@pytest.mark.slow
def test_diverging_run_stops_once_with_the_step_and_no_retry(ray_local, data, tmp_path):
    """A learning rate that blows the weights up: the run stops at the first logging window with one line naming
    the step, even with retries allowed (a retry would only meet the same NaN again)."""
    from bertpipe.jobs.pretrain.metrics.meter import NonFiniteError

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


def test_the_trainer_leaves_the_driver_s_environment_alone(tmp_path):
    """Building the trainer changes no environment variable of the driver's process (Ray Train forwards them to its
    controller: a setting there would outlive the stage)."""
    import os

    from bertpipe.jobs.pretrain.stage import trainer
    from bertpipe.jobs.pretrain.worker_spec import WorkerSpec

    spec = WorkerSpec(pretrain=base_config(), model=ModelConfig(), seed=1, vocab_tokens=TOKENS, vocab_bytes=b"",
                      tracking={}, export_uri=str(tmp_path / "export"), storage_path=str(tmp_path), run_name="r")
    before = dict(os.environ)
    trainer(spec, {})
    assert dict(os.environ) == before
