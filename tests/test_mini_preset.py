"""The `mini` preset as a user runs it (its own relative input paths, resolved from the repository root): the
config names both English dumps; (slow: a whole run, made short) pretrain writes its learning figures (baselines,
held-out accuracy, curves) beside the export; (slow: a second whole run) twice with the same seed, every
fingerprinted output of clean, vocab, pairs and pretrain has the same bytes."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from bertpipe.jobs import workflow
from bertpipe.jobs.config import load_config
from bertpipe.pipeline.framework.stage import read_manifest

REPO = Path(__file__).resolve().parents[1]
# Both phases, a held-out evaluation and a checkpoint in 4 steps; dupe_factor 1 keeps pairs short.
SHORT = ["pairs.dupe_factor=1", "pretrain.max_steps=4", "pretrain.phase1_fraction=0.5",
         "pretrain.eval_every_steps=2", "pretrain.eval_max_batches=2", "pretrain.checkpoint_every_steps=2",
         "pretrain.log_every_steps=1", "mlflow.tracking_uri='off'"]
STAGES = ["clean", "vocab", "pairs", "pretrain"]


def output_digests(workdir: Path) -> dict[str, str]:
    """{stage/output: sha256} of every output each stage's manifest lists."""
    digests = {}
    for stage in STAGES:
        manifest = read_manifest(str(workdir / stage))
        assert manifest is not None, f"{stage} committed no manifest"
        for name in manifest["outputs"]:
            digests[f"{stage}/{name}"] = hashlib.sha256((workdir / stage / name).read_bytes()).hexdigest()
    return digests


def run_mini(name: str, tmp_path_factory, monkeypatch_module) -> Path:
    monkeypatch_module.chdir(REPO)  # the preset's dump paths are relative, as a user at the repo root types them
    workdir = tmp_path_factory.mktemp(f"mini-{name}")
    workflow.run(load_config("mini", SHORT, str(workdir)), only=STAGES)
    return workdir


@pytest.fixture(scope="module")
def mini_run(ray_local, sample_dumps, tmp_path_factory, monkeypatch_module) -> Path:
    """One short run of the preset (the default suite pays for this one only)."""
    return run_mini("a", tmp_path_factory, monkeypatch_module)


@pytest.fixture(scope="module")
def two_runs(mini_run, tmp_path_factory, monkeypatch_module) -> list[Path]:
    """The same run again with the same seed (a second whole workflow: only the slow test below pays for it)."""
    return [mini_run, run_mini("b", tmp_path_factory, monkeypatch_module)]


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


# A second whole workflow (~90 s on 2 cores). Each stage's same-seed determinism is covered by a faster test:
# clean by test_clean_stage.py::test_enwiki_sample_end_to_end_and_deterministic, vocab by
# test_vocab.py::test_train_on_real_corpus_has_google_layout (a fresh interpreter writes the same bytes), pairs by
# test_pairs_stage.py::test_same_seed_same_bytes_other_seed_differs, pretrain by test_pretrain_lamb.py::
# test_lamb_retries_then_reruns_bit_exactly_from_a_checkpoint (the same seed twice: bit-identical weights, the same
# history.json and baselines.json).
@pytest.mark.slow
def test_same_seed_gives_the_same_bytes_at_every_stage(two_runs):
    a, b = (output_digests(w) for w in two_runs)
    assert a == b
    assert {k.split("/")[0] for k in a} == set(STAGES)
    assert "pretrain/export/model.safetensors" in a


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
