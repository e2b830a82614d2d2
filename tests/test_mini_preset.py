"""The `mini` preset as a user runs it (its own relative input paths, resolved from the repository root): the
config names both English dumps; (slow: a whole run, made short) pretrain writes its learning figures (baselines,
held-out accuracy, curves) beside the export, the curves a function of the figures written beside them alone.

Same seed, same bytes is tested stage by stage, each faster than a second whole run of this preset: clean by
test_clean_stage.py::test_enwiki_sample_end_to_end_and_deterministic, vocab by
test_vocab.py::test_train_on_real_corpus_has_google_layout (a fresh interpreter writes the same bytes), pairs by
test_pairs_stage.py::test_same_seed_same_bytes_other_seed_differs, pretrain's weights, history.json and
baselines.json by test_pretrain_lamb.py::test_lamb_retries_then_reruns_bit_exactly_from_a_checkpoint; the curve PNGs,
which no other test renders twice, below."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bertpipe.jobs import workflow
from bertpipe.jobs.config import load_config
from bertpipe.jobs.pretrain.learning.curves import curve_pngs
from bertpipe.pipeline.framework.stage import read_manifest

REPO = Path(__file__).resolve().parents[1]
# Both phases, a held-out evaluation and a checkpoint in 4 steps; dupe_factor 1 keeps pairs short.
SHORT = ["pairs.dupe_factor=1", "pretrain.max_steps=4", "pretrain.phase1_fraction=0.5",
         "pretrain.eval_every_steps=2", "pretrain.eval_max_batches=2", "pretrain.checkpoint_every_steps=2",
         "pretrain.log_every_steps=1", "mlflow.tracking_uri='off'"]
STAGES = ["clean", "vocab", "pairs", "pretrain"]


@pytest.fixture(scope="module")
def mini_run(ray_local, sample_dumps, tmp_path_factory, monkeypatch_module) -> Path:
    """One short run of the preset."""
    monkeypatch_module.chdir(REPO)  # the preset's dump paths are relative, as a user at the repo root types them
    workdir = tmp_path_factory.mktemp("mini")
    workflow.run(load_config("mini", SHORT, str(workdir)), only=STAGES)
    return workdir


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_preset_reads_both_english_dumps_from_the_repository_root(sample_dumps, monkeypatch):
    """What the short run below checks first, without running: from the repository root, as a user types it, the
    preset names every English dump of the sample, and they are there (`bertpipe fetch-sample`)."""
    monkeypatch.chdir(REPO)
    cfg = load_config("mini")
    inputs = [Path(p) for p in cfg.clean.input]
    assert len(inputs) == 2 and all(p.is_absolute() and p.is_file() for p in inputs), inputs
    assert {p.name for p in inputs} == {p.name for p in sample_dumps.values() if p.name.startswith("enwiki")}
    assert tuple(cfg.pairs.max_seq_lengths) == (128, 512) and cfg.pretrain.phase_steps()[1] > 0  # both phases train


# ~45 s (a whole workflow on both dumps). Learning figures: test_pretrain.py (history.json, the curves, the
# baselines) on a seq-32 run; here, the preset's own input, on real articles.
@pytest.mark.slow
def test_pretrain_writes_the_learning_figures(mini_run):
    workdir = mini_run
    manifest = read_manifest(str(workdir / "pretrain"))
    metrics = manifest["metrics"]
    # the preset reads both English dumps of the sample, not just the first
    clean = read_manifest(str(workdir / "clean"))
    assert clean["metrics"]["num_input_files"] == 2 and clean["metrics"]["articles"] > 100
    for key in ("eval_mlm_accuracy", "eval_nsp_accuracy", "baseline_mlm_accuracy", "baseline_nsp_accuracy"):
        assert 0.0 <= metrics[key] <= 1.0, key
    baselines = json.loads((workdir / "pretrain" / "baselines.json").read_text())
    assert baselines["baseline_mlm_accuracy"] == pytest.approx(metrics["baseline_mlm_accuracy"])
    # on real articles, topic overlap alone tells NotNext from IsNext far better than the majority class
    assert metrics["nsp_overlap_rule_accuracy"] > metrics["baseline_nsp_accuracy"] + 0.1, metrics
    history = json.loads((workdir / "pretrain" / "history.json").read_text())
    assert [h["step"] for h in history if "loss" in h] == [1, 2, 3, 4]
    assert [h["step"] for h in history if "eval_mlm_accuracy" in h] == [2, 4]
    for png in ("curve_loss.png", "curve_accuracy.png"):
        assert (workdir / "pretrain" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Same figures, same bytes (no time, path or process in a PNG): a run again with the same seed, whose figures
    # the tests named in the module docstring show to be the same, writes the same curves.
    again = curve_pngs(history, baselines)
    assert sorted(again) == ["curve_accuracy.png", "curve_loss.png"]
    for png, blob in again.items():
        assert (workdir / "pretrain" / png).read_bytes() == blob, png
