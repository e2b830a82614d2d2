"""Dynamic masking on in-memory batches: shapes at odd sizes, the 15% / 80-10-10 recipe, caps, whole words,
and the seeding that makes resume exact."""
from __future__ import annotations

import numpy as np
import pytest

from bertpipe.jobs.pretrain.data.masking import IGNORE_INDEX, MaskingSpec, batch_rng, mask_batch

# vocabulary of 99: the five specials, then words; ids 50.. are "##" continuation pieces
TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(45)] + [f"##p{i}" for i in range(49)]
CLS, SEP = 2, 3


def make_rows(rng, n, lo, hi):
    rows, b_starts = [], []
    for _ in range(n):
        a, b = rng.integers(1, max(2, (hi - 3) // 2), size=2)
        a_ids = rng.integers(5, 99, size=a)
        b_ids = rng.integers(5, 99, size=b)
        ids = np.concatenate([[CLS], a_ids, [SEP], b_ids, [SEP]]).astype(np.uint16)
        rows.append(ids)
        b_starts.append(a + 2)
    labels = rng.integers(0, 2, size=n).astype(np.int8)
    col = np.empty(n, dtype=object)
    col[:] = rows
    return {"input_ids": col, "segment_b_start": np.array(b_starts, np.int16), "next_sentence_label": labels}


def spec(**kw):
    args = dict(max_seq_length=128, max_predictions=20)
    args.update(kw)
    return MaskingSpec.from_vocab(TOKENS, **args)


def test_shapes_padding_and_segments_at_odd_sizes():
    rng = np.random.default_rng(1)
    batch = make_rows(rng, 13, 5, 37)
    out = mask_batch(batch, spec(max_predictions=7), np.random.default_rng(0))
    longest = max(len(r) for r in batch["input_ids"])
    B, T = out["input_ids"].shape
    assert B == 13 and T % 8 == 0 and longest <= T < longest + 8
    assert out["masked_positions"].shape == (13, 7) == out["masked_lm_labels"].shape
    for b, row in enumerate(batch["input_ids"]):
        n = len(row)
        assert out["attention_mask"][b, :n].all() and not out["attention_mask"][b, n:].any()
        assert (out["input_ids"][b, n:] == 0).all()
        start = batch["segment_b_start"][b]
        assert (out["token_type_ids"][b, :start] == 0).all()
        assert (out["token_type_ids"][b, start:n] == 1).all() and (out["token_type_ids"][b, n:] == 0).all()
        # unmasked positions keep the original token; masked ones are labelled with it
        used = out["masked_lm_labels"][b] != IGNORE_INDEX
        pos = out["masked_positions"][b][used].numpy()
        assert (out["masked_lm_labels"][b][used].numpy() == row[pos]).all()
        keep = np.setdiff1d(np.arange(n), pos)
        assert (out["input_ids"][b, keep].numpy() == row[keep]).all()
        assert list(pos) == sorted(set(pos)) and (pos > 0).all()
        assert (out["masked_positions"][b][~used] == 0).all()
    assert (out["next_sentence_label"].numpy() == batch["next_sentence_label"]).all()


def test_recipe_fractions_and_specials():
    rng = np.random.default_rng(2)
    batch = make_rows(rng, 3000, 20, 101)
    s = spec(max_predictions=40)
    out = mask_batch(batch, s, np.random.default_rng(5))
    ids, labels, pos = out["input_ids"].numpy(), out["masked_lm_labels"].numpy(), out["masked_positions"].numpy()
    used = labels != IGNORE_INDEX
    num_real = np.array([len(r) - 3 for r in batch["input_ids"]])  # minus [CLS] and two [SEP]
    chosen = used.sum(1)
    assert np.abs(chosen - np.maximum(1, np.rint(num_real * 0.15))).max() == 0
    assert not np.isin(labels[used], s.special_ids).any()  # specials are never targets
    new = ids[np.nonzero(used)[0], pos[used]]
    frac_mask = (new == s.mask_id).mean()
    frac_same = (new == labels[used]).mean()
    assert 0.78 < frac_mask < 0.82, frac_mask
    # unchanged: 10% kept plus the ~1/94 of random draws that hit the same token
    assert 0.09 < frac_same < 0.12, frac_same
    random_tokens = new[(new != s.mask_id) & (new != labels[used])]
    assert len(random_tokens) > 0.08 * used.sum() and not np.isin(random_tokens, s.special_ids).any()


def test_cap_at_max_predictions():
    rng = np.random.default_rng(3)
    batch = make_rows(rng, 5, 100, 127)
    out = mask_batch(batch, spec(max_predictions=3), np.random.default_rng(0))
    assert ((out["masked_lm_labels"] != IGNORE_INDEX).sum(1) == 3).all()


def test_seeded_per_batch_and_reproducible():
    batch = make_rows(np.random.default_rng(4), 9, 10, 60)
    a = mask_batch(batch, spec(), batch_rng(7, 0, 1, 0, 3))
    b = mask_batch(batch, spec(), batch_rng(7, 0, 1, 0, 3))
    c = mask_batch(batch, spec(), batch_rng(7, 0, 1, 1, 3))  # another worker
    d = mask_batch(batch, spec(), batch_rng(7, 0, 2, 0, 3))  # another epoch
    assert all((a[k] == b[k]).all() for k in a)
    assert not (a["masked_positions"] == c["masked_positions"]).all()
    assert not (a["masked_positions"] == d["masked_positions"]).all()


def test_whole_word_masking_takes_every_piece_of_a_word():
    rng = np.random.default_rng(6)
    batch = make_rows(rng, 400, 20, 80)
    s = spec(whole_word=True, max_predictions=30)
    out = mask_batch(batch, s, np.random.default_rng(1))
    saw_word = 0
    for b, row in enumerate(batch["input_ids"]):
        used = out["masked_lm_labels"][b] != IGNORE_INDEX
        masked = set(out["masked_positions"][b][used].tolist())
        n = len(row)
        for i in range(1, n):
            # a continuation piece after a non-special token is masked iff the token before it is
            if s.continuation[row[i]] and row[i - 1] not in s.special_ids:
                assert (i in masked) == (i - 1 in masked), (b, i)
                saw_word += i in masked
        assert len(masked) <= max(1, round((n - 3) * 0.15))
    assert saw_word > 50


def test_too_long_rows_are_refused():
    batch = make_rows(np.random.default_rng(0), 3, 50, 120)
    with pytest.raises(ValueError, match="max_seq_length"):
        mask_batch(batch, spec(max_seq_length=16), np.random.default_rng(0))


def test_missing_special_token_in_vocab():
    with pytest.raises(ValueError, match=r"\[MASK\]"):
        MaskingSpec.from_vocab([t for t in TOKENS if t != "[MASK]"], max_seq_length=8, max_predictions=2)
