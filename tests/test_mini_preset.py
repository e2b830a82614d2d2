"""The `mini` preset as a user runs it (its own relative input paths, resolved from the repository root): the
config names both English dumps.

What a run of it writes is tested stage by stage on other inputs, each faster than a whole run of this preset: the
learning figures (baselines, held-out accuracy, curves) by test_pretrain.py, held-out accuracy over its baseline on
real articles by test_pretrain_real.py; same seed, same bytes by
test_clean_stage.py::test_enwiki_sample_end_to_end_and_deterministic,
test_vocab.py::test_train_on_real_corpus_has_google_layout (a fresh interpreter writes the same bytes),
test_pairs_stage.py::test_same_seed_same_bytes_other_seed_differs, pretrain's weights, history.json and
baselines.json by test_pretrain_lamb.py::test_lamb_retries_then_reruns_bit_exactly_from_a_checkpoint and the curve
PNGs by test_learning.py::test_curves_are_png_images."""
from __future__ import annotations

from pathlib import Path

from bertpipe.jobs.config import load_config

REPO = Path(__file__).resolve().parents[1]


def test_preset_reads_both_english_dumps_from_the_repository_root(sample_dumps, monkeypatch):
    """From the repository root, as a user types it, the preset names every English dump of the sample, and they
    are there (`bertpipe fetch-sample`)."""
    monkeypatch.chdir(REPO)
    cfg = load_config("mini")
    inputs = [Path(p) for p in cfg.clean.input]
    assert len(inputs) == 2 and all(p.is_absolute() and p.is_file() for p in inputs), inputs
    assert {p.name for p in inputs} == {p.name for p in sample_dumps.values() if p.name.startswith("enwiki")}
    assert tuple(cfg.pairs.max_seq_lengths) == (128, 512) and cfg.pretrain.phase_steps()[1] > 0  # both phases train

