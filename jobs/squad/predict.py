"""From start/end logits of every window to one answer per question: the best span over the n-best start and
end positions of all the question's windows, at most `max_answer_length` tokens, both ends in the context and
the start in its max-context window; the text is the exact slice of the original context. For v2.0 also the
null margin: the smallest [CLS] score over the windows minus the best span's score (answer "" above a
threshold tuned on dev)."""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from bertpipe.jobs.squad.data import Example
from bertpipe.jobs.squad.features import Features


def best_span(feats: Features, rows: list[int], start_logits: list[np.ndarray], end_logits: list[np.ndarray],
              n_best: int, max_answer_length: int) -> tuple[float, int, int, int]:
    """(score, row, start token, end token) of the best valid span over the windows `rows`; score -inf if none."""
    best = (float("-inf"), -1, 0, 0)
    for r in rows:
        s, e = start_logits[r], end_logits[r]
        in_context = feats.char_start[r] >= 0
        for i in np.argsort(-s, kind="stable")[:n_best]:
            if not (in_context[i] and feats.max_context[r][i]):
                continue
            for j in np.argsort(-e, kind="stable")[:n_best]:
                if in_context[j] and i <= j < i + max_answer_length and s[i] + e[j] > best[0]:
                    best = (float(s[i] + e[j]), r, int(i), int(j))
    return best


def predict_answers(examples: list[Example], feats: Features, start_logits: list[np.ndarray],
                    end_logits: list[np.ndarray], n_best: int = 20,
                    max_answer_length: int = 30) -> tuple[dict[str, str], dict[str, float]]:
    """({qid: best span text}, {qid: null margin}) for every example (logits: one array per window row)."""
    rows_of: dict[int, list[int]] = defaultdict(list)
    for r, i in enumerate(feats.example_index):
        rows_of[i].append(r)
    texts, margins = {}, {}
    for i, ex in enumerate(examples):
        rows = rows_of.get(i, [])
        score, r, a, b = best_span(feats, rows, start_logits, end_logits, n_best, max_answer_length)
        null = min((float(start_logits[k][0] + end_logits[k][0]) for k in rows), default=0.0)
        if r < 0:  # no valid span anywhere: only "no answer" is possible
            texts[ex.qid], margins[ex.qid] = "", float("inf")
            continue
        texts[ex.qid] = ex.context[int(feats.char_start[r][a]):int(feats.char_end[r][b])]
        margins[ex.qid] = null - score
    return texts, margins


def apply_threshold(texts: dict[str, str], margins: dict[str, float], threshold: float) -> dict[str, str]:
    """v2.0 answers: "" where the null margin exceeds the threshold."""
    return {q: ("" if margins[q] > threshold else t) for q, t in texts.items()}
