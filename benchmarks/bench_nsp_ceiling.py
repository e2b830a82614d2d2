"""How much held-out NSP accuracy does topic overlap alone give on a pairs stage's shards?

A reference for the pretrain stage's held-out NSP figure, with no model at all: score each pair by the share of B's
content pieces (the --stopwords most frequent training pieces and the specials left out) that also occur in A; pick
the threshold that classifies the *training* rows best (low overlap = NotNext), then score the held-out rows with it.
Random NotNext segments come from another article, so this is the shortcut a small model finds first; a model that
cannot beat it has learned no more than topic overlap.

    .venv/bin/python benchmarks/bench_nsp_ceiling.py --pairs work/mini/pairs
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

NUM_SPECIAL = 5  # [PAD] [UNK] [CLS] [SEP] [MASK] come first in every vocabulary the vocab stage writes


def read(files: list[Path]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    ids, b_start, label = [], [], []
    for f in files:
        t = pq.read_table(f, columns=["input_ids", "segment_b_start", "next_sentence_label"])
        ids += [np.asarray(r, dtype=np.int64) for r in t.column("input_ids").to_pylist()]
        b_start.append(t.column("segment_b_start").to_numpy())
        label.append(t.column("next_sentence_label").to_numpy())
    return ids, np.concatenate(b_start).astype(np.int64), np.concatenate(label).astype(np.int64)


def overlap(ids: list[np.ndarray], b_start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """Share of B's distinct content pieces that also occur in A (0 when B has none)."""
    out = np.zeros(len(ids))
    for i, (row, b) in enumerate(zip(ids, b_start)):
        a, seg_b = row[1:b - 1], row[b:-1]
        a, seg_b = set(a[~stop[a]].tolist()), set(seg_b[~stop[seg_b]].tolist())
        out[i] = len(a & seg_b) / len(seg_b) if seg_b else 0.0
    return out


def best_threshold(score: np.ndarray, label: np.ndarray) -> tuple[float, float]:
    """(threshold, training accuracy) of the rule `NotNext iff score < threshold`, best over the observed scores."""
    candidates = np.unique(np.concatenate([score, [np.inf]]))
    accuracy = [float(((score < t) == (label == 1)).mean()) for t in candidates]
    k = int(np.argmax(accuracy))
    return float(candidates[k]), accuracy[k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=Path, required=True, help="a pairs stage folder (seq*/train-*.parquet, heldout)")
    ap.add_argument("--stopwords", type=int, default=100, help="most frequent training pieces left out")
    args = ap.parse_args()
    print(f"| seq | train rows | held-out rows | majority (held-out) | overlap IsNext / NotNext (held-out) | "
          f"threshold | train accuracy | held-out accuracy |\n|---|---|---|---|---|---|---|---|")
    for folder in sorted(args.pairs.glob("seq*"), key=lambda p: int(p.name[3:])):
        train_files = sorted(folder / f for f in os.listdir(folder) if f.startswith("train-"))
        ids, b_start, label = read(train_files)
        h_ids, h_b, h_label = read([folder / "heldout.parquet"])
        counts = np.bincount(np.concatenate(ids), minlength=max(int(r.max()) for r in ids + h_ids) + 1)
        counts[:NUM_SPECIAL] = counts.max() + 1  # specials count as stopwords
        stop = np.zeros(len(counts), dtype=bool)
        stop[np.argsort(-counts, kind="stable")[:args.stopwords + NUM_SPECIAL]] = True
        threshold, train_acc = best_threshold(overlap(ids, b_start, stop), label)
        h_score = overlap(h_ids, h_b, stop)
        majority = int(np.bincount(label, minlength=2).argmax())
        held_acc = float(((h_score < threshold) == (h_label == 1)).mean())
        print(f"| {folder.name[3:]} | {len(label)} | {len(h_label)} | {(h_label == majority).mean():.3f} | "
              f"{h_score[h_label == 0].mean():.3f} / {h_score[h_label == 1].mean():.3f} | {threshold:.3f} | "
              f"{train_acc:.3f} | {held_acc:.3f} |", flush=True)


if __name__ == "__main__":
    main()
