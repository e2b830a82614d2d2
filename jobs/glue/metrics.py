"""GLUE's official metrics from scikit-learn and SciPy (the calls Hugging Face's `glue` metric makes), and the averages.

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

import warnings

import numpy as np

from bertpipe.jobs.glue.tasks import GLUE_TASKS

# scikit-learn and SciPy are imported where a metric is computed (in the trials), not at import: together they
# take seconds, which `bertpipe status` and a run that skips every stage would spend for the averages alone.

# Where a score is undefined (constant predictions or labels, fewer than two rows) it is 0.0, never NaN: a
# degenerate model scores as no better than chance and the averages stay numbers. scikit-learn already answers 0.0
# for MCC and F1 (zero_division=0.0); SciPy answers NaN (and warns) for Pearson and Spearman, mapped to 0.0 here.
# MCC, F1, accuracy: the very floats of the numpy formulas used before; Pearson: within a few units in the last place
# of them, and closer to the exact value (tests/test_glue_metrics.py).


def accuracy(preds, labels) -> float:
    from sklearn import metrics as skm

    return float(skm.accuracy_score(np.asarray(labels), np.asarray(preds)))


def f1_binary(preds, labels) -> float:
    """F1 of the positive class 1 (MRPC, QQP); 0 when there is no true or predicted positive."""
    from sklearn import metrics as skm

    return float(skm.f1_score(np.asarray(labels) == 1, np.asarray(preds) == 1, zero_division=0.0))


def matthews_corrcoef(preds, labels) -> float:
    """Multiclass Matthews correlation (Gorodkin's R_K), = the binary phi coefficient; 0 when undefined."""
    from sklearn import metrics as skm

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "A single label was found", UserWarning)  # the 0.0 case
        return float(skm.matthews_corrcoef(np.asarray(labels), np.asarray(preds)))


def _correlation(name: str, x, y) -> float:
    """scipy.stats' `name` (pearsonr, spearmanr) of x and y."""
    from scipy import stats

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) != len(y):
        raise ValueError(f"{len(x)} values for {len(y)}")
    if len(x) < 2:
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stats.ConstantInputWarning)
        r = float(getattr(stats, name)(x, y).statistic)
    return 0.0 if np.isnan(r) else r


def pearson(x, y) -> float:
    return _correlation("pearsonr", x, y)


def spearman(x, y) -> float:
    """Pearson of the ranks, ties getting the mean of their ranks (scipy.stats.spearmanr)."""
    return _correlation("spearmanr", x, y)


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
