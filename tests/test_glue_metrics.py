"""GLUE metrics equal scikit-learn / SciPy on predictions for the real dev sets; the averages match the
published BERT numbers."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats
from sklearn import metrics as skm

from bertpipe.jobs.glue.metrics import (accuracy, bert_paper_average, compute_metrics, f1_binary, glue_score,
                               matthews_corrcoef, pearson, spearman, task_score)
from bertpipe.jobs.glue.tasks import TASKS, read_task


def _overlap(a: str, b: str) -> float:
    wa, wb = set(a.lower().split()), set(b.lower().split())
    return len(wa & wb) / max(1, len(wa | wb))


@pytest.fixture(scope="module")
def real(shared_glue_dir):
    """Heuristic (word-overlap / length) predictions on real dev sets: imperfect, correlated with the labels."""
    cola = read_task(str(shared_glue_dir), TASKS["CoLA"], with_test=False).dev["CoLA"]
    mrpc = read_task(str(shared_glue_dir), TASKS["MRPC"], with_test=False).dev["MRPC"]
    stsb = read_task(str(shared_glue_dir), TASKS["STS-B"], with_test=False).dev["STS-B"]
    cola_pred = np.array([int(len(s.split()) < 9) for s in cola.text_a])
    mrpc_pred = np.array([int(_overlap(a, b) > 0.45) for a, b in zip(mrpc.text_a, mrpc.text_b)])
    # Rounded to one decimal on purpose: many ties, which is where Spearman implementations differ.
    stsb_pred = np.round(np.array([5 * _overlap(a, b) for a, b in zip(stsb.text_a, stsb.text_b)]), 1)
    return {"cola": (cola_pred, cola.labels), "mrpc": (mrpc_pred, mrpc.labels), "stsb": (stsb_pred, stsb.labels)}


def test_metrics_equal_sklearn_scipy_on_real_dev_sets(real):
    p, y = real["cola"]
    assert matthews_corrcoef(p, y) == pytest.approx(skm.matthews_corrcoef(y, p), abs=1e-12)
    assert 0.0 < abs(matthews_corrcoef(p, y)) < 1.0
    p, y = real["mrpc"]
    assert f1_binary(p, y) == pytest.approx(skm.f1_score(y, p), abs=1e-12)
    assert accuracy(p, y) == pytest.approx(skm.accuracy_score(y, p), abs=1e-12)
    p, y = real["stsb"]
    assert len(np.unique(p)) < len(p) / 10  # ties present
    assert pearson(p, y) == pytest.approx(stats.pearsonr(p, y)[0], abs=1e-10)
    assert spearman(p, y) == pytest.approx(stats.spearmanr(p, y)[0], abs=1e-10)


@pytest.mark.parametrize("n,k", [(13, 2), (97, 3), (1, 2)])
def test_metrics_equal_sklearn_on_random_odd_sizes(n, k):
    rng = np.random.default_rng(n)
    y, p = rng.integers(0, k, n), rng.integers(0, k, n)
    assert matthews_corrcoef(p, y) == pytest.approx(skm.matthews_corrcoef(y, p), abs=1e-12)
    assert accuracy(p, y) == pytest.approx(skm.accuracy_score(y, p))
    if k == 2:
        assert f1_binary(p, y) == pytest.approx(skm.f1_score(y, p, zero_division=0.0))
    x = rng.normal(size=n).round(1)
    if n > 2:
        assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-10)


def test_degenerate_predictions_give_zero_not_nan():
    assert matthews_corrcoef([1, 1, 1], [0, 1, 1]) == 0.0
    assert pearson([2.0, 2.0, 2.0], [1.0, 2.0, 3.0]) == 0.0
    assert f1_binary([0, 0], [0, 0]) == 0.0
    with pytest.raises(ValueError, match="3 predictions for 2 labels"):
        compute_metrics(("accuracy",), [0, 1, 1], [0, 1])


# Leaderboard rows (gluebenchmark.com) and BERT paper Table 1, in percent.
LARGE = {"CoLA": {"CoLA": {"mcc": .605}}, "SST-2": {"SST-2": {"accuracy": .949}},
         "MRPC": {"MRPC": {"f1": .893, "accuracy": .854}}, "STS-B": {"STS-B": {"pearson": .876, "spearman": .865}},
         "QQP": {"QQP": {"f1": .721, "accuracy": .893}},
         "MNLI": {"MNLI-m": {"accuracy": .867}, "MNLI-mm": {"accuracy": .859}},
         "QNLI": {"QNLI": {"accuracy": .927}}, "RTE": {"RTE": {"accuracy": .701}}, "WNLI": {"WNLI": {"accuracy": .651}}}


def test_glue_score_is_the_leaderboard_average():
    score, complete = glue_score({t: task_score(m) for t, m in LARGE.items()})
    assert complete and round(score, 1) == 80.5  # BERT-LARGE's leaderboard score
    # MNLI is one task (mean of m and mm), not two entries: that would give 81.1.
    assert task_score(LARGE["MNLI"]) == pytest.approx((.867 + .859) / 2)
    partial, complete = glue_score({"CoLA": .5, "RTE": .7})
    assert not complete and partial == pytest.approx(60.0)


def test_bert_paper_average():
    avg, complete = bert_paper_average(LARGE)
    assert complete and round(avg, 1) == 82.1  # Table 1, BERT-LARGE
    base = {"MNLI": {"MNLI-m": {"accuracy": .846}, "MNLI-mm": {"accuracy": .834}}, "QQP": {"QQP": {"f1": .712}},
            "QNLI": {"QNLI": {"accuracy": .905}}, "SST-2": {"SST-2": {"accuracy": .935}},
            "CoLA": {"CoLA": {"mcc": .521}}, "STS-B": {"STS-B": {"spearman": .858}}, "MRPC": {"MRPC": {"f1": .889}},
            "RTE": {"RTE": {"accuracy": .664}}}
    avg, complete = bert_paper_average(base)
    assert complete and round(avg, 1) == 79.6
