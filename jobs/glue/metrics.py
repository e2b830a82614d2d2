"""GLUE's official metrics in plain numpy (scikit-learn / SciPy are test-only dependencies), and the averages.

Task score = the mean of the task's official metrics (MRPC and QQP: F1 and accuracy; STS-B: Pearson and
Spearman), MNLI = the mean of its matched and mismatched accuracy. The GLUE score is the plain mean of the nine
task scores, WNLI included, as the gluebenchmark.com leaderboard computes it (the diagnostic AX set is reported
there but not averaged). Check against the leaderboard's BERT-LARGE row: CoLA 60.5, SST-2 94.9, MRPC 89.3/85.4,
STS-B 87.6/86.5, QQP 72.1/89.3, MNLI 86.7/85.9, QNLI 92.7, RTE 70.1, WNLI 65.1 → 80.5 (tests/test_glue_metrics.py).

The BERT paper's "Average" (Table 1) is another number: WNLI left out, one metric per task (F1 for MRPC and
QQP, Spearman for STS-B, accuracy for the rest) and MNLI-m and MNLI-mm counted as two entries — nine numbers.
BASE: 84.6, 83.4, 71.2, 90.5, 93.5, 52.1, 85.8, 88.9, 66.4 → 79.6. Both are reported; scores are in percent.
"""
from __future__ import annotations

import numpy as np

from bertpipe.jobs.glue.tasks import GLUE_TASKS


def accuracy(preds, labels) -> float:
    preds, labels = np.asarray(preds), np.asarray(labels)
    return float((preds == labels).mean())


def f1_binary(preds, labels) -> float:
    """F1 of the positive class 1 (MRPC, QQP); 0 when there is no true or predicted positive."""
    preds, labels = np.asarray(preds) == 1, np.asarray(labels) == 1
    tp = float(np.sum(preds & labels))
    denom = float(np.sum(preds) + np.sum(labels))
    return 2.0 * tp / denom if denom else 0.0


def matthews_corrcoef(preds, labels) -> float:
    """Multiclass Matthews correlation (Gorodkin's R_K), = the binary phi coefficient; 0 when undefined."""
    preds, labels = np.asarray(preds), np.asarray(labels)
    classes, inv = np.unique(np.concatenate([labels, preds]), return_inverse=True)
    k = len(classes)
    y, p = inv[:len(labels)], inv[len(labels):]
    conf = np.zeros((k, k), dtype=np.float64)
    np.add.at(conf, (y, p), 1.0)
    t, q = conf.sum(axis=1), conf.sum(axis=0)
    c, s = np.trace(conf), conf.sum()
    denom = np.sqrt((s * s - q @ q) * (s * s - t @ t))
    return float((c * s - t @ q) / denom) if denom else 0.0


def pearson(x, y) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    x, y = x - x.mean(), y - y.mean()
    denom = np.sqrt((x @ x) * (y @ y))
    return float(x @ y / denom) if denom else 0.0


def _rank(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties get the mean of their ranks (as scipy.stats.rankdata's default)."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], len(x)]
    mean_rank = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def spearman(x, y) -> float:
    return pearson(_rank(np.asarray(x, dtype=np.float64)), _rank(np.asarray(y, dtype=np.float64)))


METRICS = {"accuracy": accuracy, "f1": f1_binary, "mcc": matthews_corrcoef, "pearson": pearson,
           "spearman": spearman}


def compute_metrics(names: tuple[str, ...], preds, labels) -> dict[str, float]:
    if len(preds) != len(labels):
        raise ValueError(f"{len(preds)} predictions for {len(labels)} labels")
    return {name: METRICS[name](preds, labels) for name in names}


def task_score(metrics_by_split: dict[str, dict[str, float]]) -> float:
    """Mean over the task's dev sets (MNLI: m and mm) of the mean of each set's metrics; in [0, 1]."""
    per_split = [float(np.mean(list(m.values()))) for m in metrics_by_split.values()]
    return float(np.mean(per_split))




def glue_score(task_scores: dict[str, float]) -> tuple[float, bool]:
    """(mean of the task scores in percent, complete) — complete only when all nine tasks are there;
    otherwise the mean over the tasks given (a partial score, never comparable to the leaderboard)."""
    present = [task_scores[t] for t in GLUE_TASKS if t in task_scores]
    if not present:
        return float("nan"), False
    return 100.0 * float(np.mean(present)), len(present) == len(GLUE_TASKS)


# (task, dev-set name, metric) entries of the BERT paper's Table 1 average.
BERT_PAPER_ENTRIES = (("MNLI", "MNLI-m", "accuracy"), ("MNLI", "MNLI-mm", "accuracy"), ("QQP", "QQP", "f1"),
                      ("QNLI", "QNLI", "accuracy"), ("SST-2", "SST-2", "accuracy"), ("CoLA", "CoLA", "mcc"),
                      ("STS-B", "STS-B", "spearman"), ("MRPC", "MRPC", "f1"), ("RTE", "RTE", "accuracy"))


def bert_paper_average(metrics: dict[str, dict[str, dict[str, float]]]) -> tuple[float, bool]:
    """metrics[task][dev set][metric] → (BERT paper average in percent, complete)."""
    values = [metrics[t][s][m] for t, s, m in BERT_PAPER_ENTRIES if m in metrics.get(t, {}).get(s, {})]
    if not values:
        return float("nan"), False
    return 100.0 * float(np.mean(values)), len(values) == len(BERT_PAPER_ENTRIES)
