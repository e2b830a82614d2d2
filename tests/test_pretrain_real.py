"""The pretrain stage on REAL shards: clean → vocab → pairs built by the workflow from the enwiki sample (the
`real_pairs` fixture), then ZeRO 2 trains the tiny BERT on them (2 CPU workers, local Ray).

What "learns" means here: the training loss falls clearly, and the held-out MLM accuracy beats the
most-frequent-token baseline — always answering "the", the best a model that ignores context can do. A tiny
model first learns exactly that unigram answer (loss ≈ 7.45, accuracy ≈ the baseline, for the first ~200 steps
at batch 16) and only then starts to read the context; the recipe below (batch 16, lr 2e-3, square-root decay,
no dropout, 600 steps) was picked as the shortest that got clear of the baseline on every seed tried.
"""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from bertpipe.jobs.pretrain.data.masking import MaskingSpec
from bertpipe.jobs.pretrain.stage import run_stage
from bertpipe.jobs.pretrain.config import ModelConfig, PhaseConfig, PretrainConfig
from bertpipe.pipeline.framework.stage import StageContext, StageInput, read_manifest
from bertpipe.pipeline.formats.vocabulary import load_vocab, vocab_file

# Slow as a whole (the real shards, then 600 steps). One ZeRO stage trains here, ZeRO 2: the one no faster test
# trains with AdamW through the stage. The others are covered faster, on synthetic shards: ZeRO 1 learns
# (test_pretrain.py::test_zero1_learns_and_tracks_mlflow), ZeRO 3 learns and takes ZeRO 1's steps through the stage
# (test_pretrain.py::test_two_phases_zero3_learns_and_ends_at_phase2_length), ZeRO 2 and 3 end with ZeRO 1's weights,
# moments and losses on one and two workers (test_repartition.py::test_zero_stages_compute_the_same_training), ZeRO 2
# learns with LAMB (test_pretrain_lamb.py::test_bert_large_lamb_preset_shrunk_by_overrides_learns); pretrain on
# shards the real workflow built from the enwiki sample also runs in test_mini_preset.py and in conftest's `made_run`.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEQ = 64
STEPS = 600
LOG_EVERY = 50
SEED = 7
MARGIN = 0.02  # accuracy points above the baseline; observed 2.5–4 at 500–700 steps over seeds 7, 8, 9


def real_config(zero_stage: int) -> PretrainConfig:
    return PretrainConfig(
        num_workers=2, cpus_per_worker=1, max_steps=STEPS, zero_stage=zero_stage,
        # Small batches, many steps: per sequence seen, batch 16 leaves the unigram plateau sooner than 32 or 64.
        phases=(PhaseConfig(max_seq_length=SEQ, max_predictions_per_seq=10, global_batch_size=16,
                            micro_batch_size=8, learning_rate=2e-3, warmup_steps=30),),
        # Square-root decay keeps the rate up through the escape from the plateau; higher peaks (≥ 3e-3) keep the
        # tiny model stuck on the unigram answer instead.
        decay_power=0.5,
        # 4,738 rows per worker: 600 steps × 8 rows stay inside one epoch. 50 eval batches of 32 per worker cover
        # the whole held-out shard, so the baseline below is computed on exactly the rows evaluated.
        log_every_steps=LOG_EVERY, eval_every_steps=0, eval_max_batches=50, checkpoint_every_steps=STEPS,
        shuffle_buffer_rows=1000, max_failures=0)


def baseline_accuracy(pairs_uri: str, tokens: list[str]) -> float:
    """Expected held-out MLM accuracy of always predicting the commonest maskable token.

    Weighted as the masker picks positions: a row with n maskable (non-special) tokens gets
    k = min(max_predictions, max(1, round(0.15 n))) predictions spread evenly over them."""
    spec = MaskingSpec.from_vocab(tokens, max_seq_length=SEQ, max_predictions=10)
    weight = np.zeros(len(tokens))
    for row in pq.read_table(Path(pairs_uri) / f"seq{SEQ}" / "heldout.parquet").column("input_ids").to_pylist():
        ids = np.asarray(row, dtype=np.int64)
        ids = ids[~np.isin(ids, spec.special_ids)]
        k = min(spec.max_predictions, max(1, round(len(ids) * spec.masked_lm_prob)))
        np.add.at(weight, ids, k / len(ids))
    return float(weight.max() / weight.sum())


@pytest.fixture(scope="module")
def real_inputs(real_pairs) -> dict[str, StageInput]:
    return {n: StageInput(n, str(real_pairs / n), read_manifest(str(real_pairs / n))) for n in ("pairs", "vocab")}


@pytest.fixture(scope="module")
def train(ray_local, real_inputs, tmp_path_factory):
    """train(zero_stage) -> (final metrics, [(step, loss)] from MLflow); each stage trains once per module."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("pretrain_real")
    uri = f"sqlite:///{root}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("pretrain-real", artifact_location=str(root / "artifacts"))

    @lru_cache(maxsize=None)
    def run(zero_stage: int) -> tuple[dict[str, float], list[tuple[int, float]]]:
        mlflow_run = client.create_run(experiment)
        out = root / f"zero{zero_stage}" / "pretrain"
        out.mkdir(parents=True)
        ctx = StageContext(
            name="pretrain", output_uri=str(out), seed=SEED, inputs=real_inputs,
            config={"model": ModelConfig(preset="tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                    "pretrain": real_config(zero_stage)},
            tracking={"tracking_uri": uri, "run_id": mlflow_run.info.run_id, "experiment_id": experiment})
        metrics = run_stage(ctx).metrics
        history = [(m.step, m.value) for m in client.get_metric_history(mlflow_run.info.run_id, "train/loss")]
        return metrics, sorted(history)

    return run


def test_real_shards_come_from_the_workflow(real_inputs):
    pairs = real_inputs["pairs"].manifest
    assert pairs["stage"] == "pairs" and pairs["inputs"]["vocab"] == real_inputs["vocab"].manifest["output_id"]
    heldout = pq.read_metadata(Path(real_inputs["pairs"].uri) / f"seq{SEQ}" / "heldout.parquet").num_rows
    assert heldout >= 500, "too few held-out instances to measure accuracy to a point"


@pytest.mark.parametrize("zero_stage", [2])  # one stage: see the comment above pytestmark
def test_zero_stage_learns_on_real_shards(train, real_inputs, zero_stage):
    metrics, history = train(zero_stage)
    tokens = load_vocab(vocab_file(real_inputs["vocab"].uri))
    assert metrics["step"] == STEPS and metrics["seq_length"] == SEQ
    assert [s for s, _ in history] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    first, last = history[0][1], history[-1][1]
    uniform = math.log(len(tokens)) + math.log(2)  # the loss of uniform MLM + NSP guesses, where training starts
    assert last < first - 0.5, history
    assert metrics["loss"] < uniform - 1.0, (metrics, uniform)
    baseline = baseline_accuracy(real_inputs["pairs"].uri, tokens)
    assert 0.02 < baseline < 0.2  # sanity: English text, 4,000 pieces: "the" is ~5% of the tokens
    assert metrics["eval_mlm_accuracy"] > baseline + MARGIN, (metrics["eval_mlm_accuracy"], baseline)
