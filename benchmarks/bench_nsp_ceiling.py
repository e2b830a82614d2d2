"""How much held-out NSP accuracy does topic overlap alone give on a pairs stage's shards?

A reference for the pretrain stage's held-out NSP figure, with no model at all: score each pair by the share of B's
content pieces (the 100 commonest training pieces and the specials left out) that also occur in A; pick the
threshold that classifies the *training* rows best (low overlap = NotNext), then score the held-out rows with it.
Random NotNext segments come from another article, so this is the shortcut a small model could find first. The
pretrain stage writes the same figure for its final sequence length (`nsp_overlap_rule_accuracy`,
jobs/pretrain/learning/baselines.py); this script gives it for every sequence length, with the overlap of each class.

    .venv/bin/python benchmarks/bench_nsp_ceiling.py --pairs work/mini/pairs --vocab work/mini/vocab/vocab.txt
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bertpipe.jobs.pretrain.learning.baselines import best_threshold, content_overlap, rule_stopwords, token_counts
from bertpipe.jobs.pretrain.data.masking import MaskingSpec

ALL_ROWS = 1 << 40


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=Path, required=True, help="a pairs stage folder (seq*/train-*.parquet, heldout)")
    ap.add_argument("--vocab", type=Path, required=True, help="the vocabulary the shards were tokenized with")
    args = ap.parse_args()
    tokens = args.vocab.read_text(encoding="utf-8").splitlines()
    special_ids = MaskingSpec.from_vocab(tokens, max_seq_length=8, max_predictions=1).special_ids
    print("| seq | train rows | held-out rows | majority (held-out) | overlap IsNext / NotNext (held-out) | "
          "threshold | train accuracy | held-out accuracy |\n|---|---|---|---|---|---|---|---|")
    for folder in sorted(args.pairs.resolve().glob("seq*"), key=lambda p: int(p.name[3:])):
        train = [str(f) for f in sorted(folder.glob("train-*.parquet"))]
        stopword = rule_stopwords(token_counts(train, len(tokens)), special_ids)
        score, label = content_overlap(train, stopword, ALL_ROWS)
        h_score, h_label = content_overlap([str(folder / "heldout.parquet")], stopword, ALL_ROWS)
        threshold = best_threshold(score, label)
        majority = int(np.bincount(label, minlength=2).argmax())
        print(f"| {folder.name[3:]} | {len(label)} | {len(h_label)} | {(h_label == majority).mean():.3f} | "
              f"{h_score[h_label == 0].mean():.3f} / {h_score[h_label == 1].mean():.3f} | {threshold:.3f} | "
              f"{((score < threshold) == (label == 1)).mean():.3f} | "
              f"{((h_score < threshold) == (h_label == 1)).mean():.3f} |", flush=True)


if __name__ == "__main__":
    main()
