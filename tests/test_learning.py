"""What proves pre-training learns, without Ray: the `mini` preset loads and is checked, whole-word masking keeps
BERT's recipe (whole words, the 15% budget, 80/10/10, seeded), the trivial-predictor baselines score what they
should, and the curves are real PNGs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from bertpipe.jobs.config import load_config
from bertpipe.jobs.pretrain.learning.baselines import baselines, best_threshold
from bertpipe.jobs.pretrain.learning.curves import curve_pngs
from bertpipe.jobs.pretrain.data.masking import IGNORE_INDEX, MaskingSpec, mask_batch
from bertpipe.pipeline.formats.shards import shard_meta, shard_schema, write_shard

REPO = Path(__file__).resolve().parents[1]
# the five specials, 20 word starts (ids 5..24), 20 "##" continuation pieces (ids 25..44)
TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(20)] + [f"##c{i}" for i in range(20)]
CLS, SEP, FIRST_PIECE = 2, 3, 25


def test_mini_preset_loads_and_is_checked():
    cfg = load_config(str(REPO / "configs" / "mini.yaml"), base=str(REPO))
    assert cfg.model.preset == "bert-tiny" and cfg.pretrain.whole_word_masking
    assert len(cfg.pretrain.phases) == 2 and all(cfg.pretrain.phase_steps())
    # every English dump the sample provides, and evaluation on held-out documents
    assert sorted(Path(p).name.split("-")[0] for p in cfg.clean.input) == ["enwiki", "enwiki"]
    assert cfg.pairs.heldout_fraction > 0 and cfg.pretrain.eval_every_steps > 0
    assert cfg.ray.num_cpus > cfg.pretrain.num_workers * cfg.pretrain.cpus_per_worker


def word_rows(rng, n: int) -> dict:
    """Rows of words of 1-4 pieces: a word start, then 0-3 continuation pieces."""
    rows = []
    for _ in range(n):
        pieces = []
        for _ in range(int(rng.integers(8, 30))):
            pieces.append(int(rng.integers(5, 25)))
            pieces += [int(x) for x in rng.integers(FIRST_PIECE, 45, size=int(rng.integers(0, 4)))]
        rows.append(np.array([CLS, *pieces, SEP], dtype=np.uint16))
    col = np.empty(n, dtype=object)
    col[:] = rows
    return {"input_ids": col, "segment_b_start": np.array([len(r) for r in rows], np.int16),
            "next_sentence_label": np.zeros(n, np.int8)}


def words_of(row: np.ndarray) -> list[set[int]]:
    words: list[set[int]] = []
    for i, t in enumerate(row):
        if t in (CLS, SEP):
            continue
        if t >= FIRST_PIECE and words:
            words[-1].add(i)
        else:
            words.append({i})
    return words


def wwm_spec(**kw) -> MaskingSpec:
    return MaskingSpec.from_vocab(TOKENS, max_seq_length=160, max_predictions=kw.pop("max_predictions", 40),
                                  whole_word=True, **kw)


def test_whole_word_masking_masks_every_piece_of_a_chosen_word_and_keeps_the_budget():
    batch = word_rows(np.random.default_rng(0), 300)
    out = mask_batch(batch, wwm_spec(), np.random.default_rng(1))
    chosen_total = budget_total = multi_piece = 0
    for b, row in enumerate(batch["input_ids"]):
        used = out["masked_lm_labels"][b] != IGNORE_INDEX
        masked = set(out["masked_positions"][b][used].tolist())
        for word in words_of(row):
            assert word <= masked or not word & masked, (b, sorted(word), sorted(masked))
            multi_piece += len(word) > 1 and word <= masked
        budget = max(1, round((len(row) - 2) * 0.15))
        assert len(masked) <= budget
        chosen_total += len(masked)
        budget_total += budget
    assert multi_piece > 100
    # a word that would overflow the budget is skipped, so rows may fall a piece or two short, rarely more
    assert chosen_total >= 0.95 * budget_total, (chosen_total, budget_total)


def test_whole_word_masking_keeps_80_10_10_and_is_seeded():
    batch = word_rows(np.random.default_rng(2), 2000)
    spec = wwm_spec()
    out = mask_batch(batch, spec, np.random.default_rng(3))
    ids, labels, pos = out["input_ids"].numpy(), out["masked_lm_labels"].numpy(), out["masked_positions"].numpy()
    used = labels != IGNORE_INDEX
    new = ids[np.nonzero(used)[0], pos[used]]
    assert 0.78 < (new == spec.mask_id).mean() < 0.82
    assert 0.09 < (new == labels[used]).mean() < 0.12  # 10% kept + random draws of the same token
    again = mask_batch(batch, spec, np.random.default_rng(3))
    other = mask_batch(batch, spec, np.random.default_rng(4))
    assert all(np.array_equal(out[k], again[k]) for k in out)
    assert not np.array_equal(out["masked_positions"], other["masked_positions"])


def write_rows(path: Path, rows: list[list[int]], labels: list[int], b_start=lambda r: len(r) // 2) -> str:
    meta = shard_meta(vocab_hash="h", vocab_size=len(TOKENS), do_lower_case=True, max_seq_length=64,
                      special_ids={t: i for i, t in enumerate(TOKENS[:5])})
    table = pa.table({"input_ids": pa.array(rows, pa.list_(pa.uint16())),
                      "segment_b_start": pa.array([b_start(r) for r in rows], pa.int16()),
                      "next_sentence_label": pa.array(labels, pa.int8()),
                      "num_tokens": pa.array([len(r) for r in rows], pa.int16())})
    write_shard(str(path), table.cast(shard_schema(len(TOKENS), 64, meta)))
    return str(path)


def test_baselines_take_the_training_majority_and_score_it_on_held_out(tmp_path):
    rng = np.random.default_rng(5)
    # training: token 7 is the commonest and 70% of the pairs are NotNext (1)
    train_rows = [[CLS, *([7] * 20), *rng.integers(8, 25, size=20).tolist(), SEP] for _ in range(200)]
    train = write_rows(tmp_path / "train.parquet", train_rows, [1] * 140 + [0] * 60)
    # held out: token 7 is a quarter of the text, token 9 half of it (commonest there, but not in training);
    # 40% NotNext
    held_rows = [[CLS, *rng.permutation([7] * 10 + [9] * 20 + [11] * 10).tolist(), SEP] for _ in range(400)]
    held = write_rows(tmp_path / "heldout.parquet", held_rows, [1] * 160 + [0] * 240)
    spec = MaskingSpec.from_vocab(TOKENS, max_seq_length=64, max_predictions=10)
    base = baselines([train], held, spec)
    assert base["baseline_mlm_token_id"] == 7 and base["baseline_nsp_label"] == 1
    assert base["baseline_mlm_targets"] == 400 * 6  # 15% of 40 maskable tokens per row
    assert base["baseline_mlm_accuracy"] == pytest.approx(0.25, abs=0.03)
    assert base["baseline_nsp_accuracy"] == pytest.approx(0.4)
    assert baselines([train], held, spec) == base  # fixed masks: the same figure on every run


def test_curves_are_png_images():
    history = [{"step": s, "loss": 9 - s / 50, "mlm_loss": 8 - s / 50, "mlm_accuracy": s / 1000,
                "nsp_accuracy": 0.5 + s / 1000} for s in range(10, 110, 10)]
    history += [{"step": 50, "eval_mlm_accuracy": 0.1, "eval_nsp_accuracy": 0.6, "eval_mlm_loss": 7.0}]
    pngs = curve_pngs(history, {"baseline_mlm_accuracy": 0.05, "baseline_nsp_accuracy": 0.5})
    assert sorted(pngs) == ["curve_accuracy.png", "curve_loss.png"]
    assert all(blob.startswith(b"\x89PNG\r\n\x1a\n") and len(blob) > 5000 for blob in pngs.values())
    # the same figures, the same bytes, in another process too: no time, path or process id in a PNG, so a run
    # again with the same seed writes the same curves
    code = ("import json, sys; from bertpipe.jobs.pretrain.learning.curves import curve_pngs; "
            "h, b = json.loads(sys.argv[1]); sys.stdout.buffer.write(curve_pngs(h, b)['curve_loss.png'])")
    figures = json.dumps([history, {"baseline_mlm_accuracy": 0.05, "baseline_nsp_accuracy": 0.5}])
    again = subprocess.run([sys.executable, "-c", code, figures], capture_output=True, timeout=300, check=True)
    assert again.stdout == pngs["curve_loss.png"]


def test_best_threshold_is_the_training_optimum_of_the_notnext_below_rule():
    score = np.array([0.4, 0.1, 0.3, 0.2, 0.3])
    label = np.array([0, 1, 0, 1, 1])  # NotNext below 0.3, but one NotNext sits at 0.3 beside an IsNext
    t = best_threshold(score, label)
    assert t == pytest.approx(0.3)  # 4 of 5 right; t = 0.4 also scores 4 of 5, the smaller wins
    assert best_threshold(np.array([0.5, 0.5]), np.array([1, 1])) == 2.0  # all NotNext: "always NotNext"
    assert best_threshold(np.array([0.5, 0.5]), np.array([0, 0])) == 0.5  # all IsNext: nothing is below


def topic_segment(rng, topic: int) -> list[int]:
    """8 pieces: the function words 5-8 (the commonest, left out by the rule) and the 4 ids of one of 4 topics."""
    return rng.permutation([*range(5, 9), *range(9 + 4 * topic, 13 + 4 * topic)]).tolist()


def topic_rows(rng, labels: list[int], same_topic_notnext: int = 0) -> list[list[int]]:
    """[CLS] A [SEP] B [SEP] (B starts at 10): IsNext (0) shares A's topic; NotNext (1) takes another topic,
    except the first `same_topic_notnext` NotNext rows."""
    rows, seen_notnext = [], 0
    for label in labels:
        topic = other = int(rng.integers(4))
        if label == 1:
            seen_notnext += 1
            if seen_notnext > same_topic_notnext:
                other = (topic + 1 + int(rng.integers(3))) % 4
        rows.append([CLS, *topic_segment(rng, topic), SEP, *topic_segment(rng, other), SEP])
    return rows


def test_nsp_overlap_rule_separates_topics_and_counts_its_misses_on_held_out(tmp_path):
    rng = np.random.default_rng(3)
    train_labels = [0, 1] * 100
    train = write_rows(tmp_path / "train.parquet", topic_rows(rng, train_labels), train_labels,
                       b_start=lambda r: 10)
    # held out: 100 IsNext, 100 NotNext of which 20 drew a B of A's own topic (the rule calls those IsNext)
    held_labels = [1] * 100 + [0] * 100
    held = write_rows(tmp_path / "heldout.parquet", topic_rows(rng, held_labels, same_topic_notnext=20),
                      held_labels, b_start=lambda r: 10)
    spec = MaskingSpec.from_vocab(TOKENS, max_seq_length=64, max_predictions=10)
    base = baselines([train], held, spec)
    assert 0 < base["nsp_overlap_rule_threshold"] <= 1
    assert base["nsp_overlap_rule_accuracy"] == pytest.approx(180 / 200)
    assert base["baseline_nsp_accuracy"] == pytest.approx(0.5)
