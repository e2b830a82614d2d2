"""Is pre-training learning anything? The baselines a held-out accuracy must beat (the curves that show it:
curves.py).

- MLM baseline: always predict the token most frequent among the *training* rows' maskable tokens, scored on the
  held-out rows' masked targets drawn exactly as the final evaluation draws them (token-level 15%, the caps).
- NSP baseline: always predict the training rows' majority label, scored on the held-out rows.
- NSP overlap rule, a reference above the baseline: no model, NotNext when few of segment B's content pieces
  occur in segment A, with the threshold that is best on the training rows. Random NotNext segments come from
  another article, so this is the shortcut topic gives; a held-out NSP figure below it has learned less than that.

Driver-side, pure numpy/pyarrow: a test calls it on shards it wrote itself.
"""
from __future__ import annotations


import numpy as np
import pyarrow.parquet as pq

from bertpipe.jobs.pretrain.data.masking import IGNORE_INDEX, MaskingSpec, mask_batch
from bertpipe.pipeline.framework import storage

BASELINE_SEED = 20_191  # any fixed value: the baseline's masks are the same on every run
# Bounds that keep the driver's work small on a full Wikipedia run; the commonest token and label of a few
# shuffled shards are those of all of them.
MAX_TRAIN_SHARDS = 4
MAX_HELDOUT_ROWS = 20_000
MAX_RULE_TRAIN_ROWS = 50_000
# The overlap rule ignores the commonest pieces (function words, punctuation): at most this many, and at most a
# tenth of the vocabulary.
RULE_STOPWORDS = 100


def _read(uri: str, columns: list[str]):
    fs, path = storage.resolve(uri)
    with fs.open_input_file(path) as f:
        return pq.read_table(f, columns=columns)


def token_counts(uris: list[str], vocab_size: int) -> np.ndarray:
    """How often each token id occurs in the shards' input_ids (int64 [vocab_size])."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for uri in uris:
        flat = _read(uri, ["input_ids"]).column("input_ids").combine_chunks().flatten()
        counts += np.bincount(flat.to_numpy(zero_copy_only=False).astype(np.int64), minlength=vocab_size)
    return counts


def nsp_labels(uris: list[str]) -> np.ndarray:
    return np.concatenate([_read(u, ["next_sentence_label"]).column("next_sentence_label").to_numpy()
                           for u in uris]).astype(np.int64)


def heldout_targets(uri: str, spec: MaskingSpec, batch_size: int = 256) -> np.ndarray:
    """The held-out MLM targets (token ids) of one masking pass with a fixed seed."""
    table = _read(uri, ["input_ids", "segment_b_start", "next_sentence_label"]).slice(0, MAX_HELDOUT_ROWS)
    rng = np.random.default_rng(BASELINE_SEED)
    targets = []
    for start in range(0, table.num_rows, batch_size):
        part = table.slice(start, batch_size)
        batch = {"input_ids": part.column("input_ids").to_pylist(),
                 "segment_b_start": part.column("segment_b_start").to_numpy(),
                 "next_sentence_label": part.column("next_sentence_label").to_numpy()}
        labels = mask_batch(batch, spec, rng)["masked_lm_labels"].numpy()
        targets.append(labels[labels != IGNORE_INDEX])
    return np.concatenate(targets) if targets else np.zeros(0, dtype=np.int64)


def content_overlap(uris: list[str], stopword: np.ndarray, max_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(score, NSP label) of up to max_rows rows: the share of B's distinct content pieces (stopword[id] False)
    that also occur in A; 0 when B has none."""
    scores, labels, left = [], [], max_rows
    for uri in uris:
        table = _read(uri, ["input_ids", "segment_b_start", "next_sentence_label"]).slice(0, left)
        b_start = table.column("segment_b_start").to_numpy().astype(np.int64)
        for row, b in zip(table.column("input_ids").to_pylist(), b_start):
            a = {t for t in row[1:b - 1] if not stopword[t]}
            seg_b = {t for t in row[b:-1] if not stopword[t]}
            scores.append(len(a & seg_b) / len(seg_b) if seg_b else 0.0)
        labels.append(table.column("next_sentence_label").to_numpy().astype(np.int64))
        left -= table.num_rows
        if left <= 0:
            break
    return np.asarray(scores, dtype=np.float64), np.concatenate(labels) if labels else np.zeros(0, np.int64)


def best_threshold(score: np.ndarray, label: np.ndarray) -> float:
    """The t that maximises the accuracy of "NotNext (1) iff score < t" on these rows; ties go to the smallest t.
    Scores lie in [0, 1], so t = 2 means "always NotNext". One sort, no loop over candidates."""
    if len(score) == 0:
        return 2.0
    order = np.argsort(score, kind="stable")
    s, notnext = score[order], label[order] == 1
    # For t = s[i]: rows 0..i-1 are called NotNext, rows i.. IsNext.
    notnext_below = np.concatenate([[0], np.cumsum(notnext)])
    isnext_below = np.concatenate([[0], np.cumsum(~notnext)])
    cut = np.concatenate([np.flatnonzero(np.r_[True, s[1:] != s[:-1]]), [len(s)]])
    right = notnext_below[cut] + (isnext_below[-1] - isnext_below[cut])
    k = int(np.argmax(right))
    return float(s[cut[k]]) if cut[k] < len(s) else 2.0


def rule_stopwords(counts: np.ndarray, special_ids: tuple[int, ...]) -> np.ndarray:
    """bool [vocab]: the pieces the overlap rule ignores, the commonest in `counts` and the specials."""
    stopword = np.zeros(len(counts), dtype=bool)
    counts = counts.copy()
    counts[list(special_ids)] = -1
    stopword[np.argsort(-counts, kind="stable")[:min(RULE_STOPWORDS, len(counts) // 10)]] = True
    stopword[list(special_ids)] = True
    return stopword


def nsp_overlap_rule(train_uris: list[str], heldout_uri: str, counts: np.ndarray,
                     special_ids: tuple[int, ...]) -> dict[str, float]:
    """The overlap rule's threshold (fitted on training rows) and its held-out accuracy; counts = training piece
    counts, from which the stopwords are taken."""
    stopword = rule_stopwords(counts, special_ids)
    threshold = best_threshold(*content_overlap(train_uris, stopword, MAX_RULE_TRAIN_ROWS))
    score, label = content_overlap([heldout_uri], stopword, MAX_HELDOUT_ROWS)
    accuracy = float(((score < threshold) == (label == 1)).mean()) if len(label) else 0.0
    return {"nsp_overlap_rule_accuracy": accuracy, "nsp_overlap_rule_threshold": threshold}


def baselines(train_uris: list[str], heldout_uri: str, spec: MaskingSpec) -> dict[str, float]:
    """Held-out accuracy of the two trivial predictors, plus which token and label they predict, and of the NSP
    overlap rule."""
    train_uris = train_uris[:MAX_TRAIN_SHARDS]
    counts = token_counts(train_uris, spec.vocab_size)
    counts[list(spec.special_ids)] = 0  # never a target
    top = int(np.argmax(counts))
    targets = heldout_targets(heldout_uri, spec)
    majority = int(np.bincount(nsp_labels(train_uris), minlength=2).argmax())
    held_nsp = nsp_labels([heldout_uri])[:MAX_HELDOUT_ROWS]
    return {"baseline_mlm_accuracy": float((targets == top).mean()) if len(targets) else 0.0,
            "baseline_mlm_token_id": float(top), "baseline_mlm_targets": float(len(targets)),
            "baseline_nsp_accuracy": float((held_nsp == majority).mean()) if len(held_nsp) else 0.0,
            "baseline_nsp_label": float(majority),
            **nsp_overlap_rule(train_uris, heldout_uri, counts, spec.special_ids)}
