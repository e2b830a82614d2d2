"""GLUE metrics (scikit-learn / SciPy since issue 36) give the figures of the hand-written numpy formulas they
replaced, kept below as the reference, on predictions for the real dev sets and on the degenerate cases; the
averages match the published BERT numbers."""
from __future__ import annotations

import math
import warnings
from decimal import Decimal, getcontext
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats
from sklearn import metrics as skm

from bertpipe.jobs.glue.metrics import (accuracy, bert_paper_average, compute_metrics, f1_binary, glue_score,
                               matthews_corrcoef, pearson, spearman, task_score)
from bertpipe.jobs.glue.tasks import TASKS, read_task


# The numpy formulas jobs/glue/metrics.py computed before issue 36, verbatim: the reference the library calls
# must reproduce.
def ref_accuracy(preds, labels) -> float:
    preds, labels = np.asarray(preds), np.asarray(labels)
    return float((preds == labels).mean())


def ref_f1_binary(preds, labels) -> float:
    preds, labels = np.asarray(preds) == 1, np.asarray(labels) == 1
    tp = float(np.sum(preds & labels))
    denom = float(np.sum(preds) + np.sum(labels))
    return 2.0 * tp / denom if denom else 0.0


def ref_matthews_corrcoef(preds, labels) -> float:
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


def ref_pearson(x, y) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    x, y = x - x.mean(), y - y.mean()
    denom = np.sqrt((x @ x) * (y @ y))
    return float(x @ y / denom) if denom else 0.0


def _ref_rank(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], len(x)]
    mean_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def ref_spearman(x, y) -> float:
    return ref_pearson(_ref_rank(np.asarray(x, dtype=np.float64)), _ref_rank(np.asarray(y, dtype=np.float64)))


def exact_pearson(x, y) -> Decimal:
    """Pearson's r of the float inputs in exact rational arithmetic, then a 40-digit square root."""
    x, y = [Fraction(float(v)) for v in x], [Fraction(float(v)) for v in y]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    r2 = sxy * sxy / (sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))
    getcontext().prec = 40
    r = (Decimal(r2.numerator) / Decimal(r2.denominator)).sqrt()
    return r if sxy >= 0 else -r


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
    sst2 = read_task(str(shared_glue_dir), TASKS["SST-2"], with_test=False).dev["SST-2"]
    wnli = read_task(str(shared_glue_dir), TASKS["WNLI"], with_test=False).dev["WNLI"]
    negative = {"not", "no", "bad", "dull"}
    sst2_pred = np.array([int(not negative & set(s.lower().split())) for s in sst2.text_a])
    wnli_pred = np.array([int(_overlap(a, b) > 0.3) for a, b in zip(wnli.text_a, wnli.text_b)])
    stsb_raw = np.array([5 * _overlap(a, b) for a, b in zip(stsb.text_a, stsb.text_b)])  # few ties
    return {"cola": (cola_pred, cola.labels), "mrpc": (mrpc_pred, mrpc.labels), "stsb": (stsb_pred, stsb.labels),
            "sst2": (sst2_pred, sst2.labels), "wnli": (wnli_pred, wnli.labels), "stsb_raw": (stsb_raw, stsb.labels)}


def test_library_metrics_give_the_old_figures_bit_for_bit_on_real_dev_sets(real):
    """MCC, F1, accuracy and Spearman: the very same float as the numpy formulas they replaced."""
    for task in ("cola", "mrpc", "sst2", "wnli"):
        p, y = real[task]
        assert accuracy(p, y) == ref_accuracy(p, y), task
        assert matthews_corrcoef(p, y) == ref_matthews_corrcoef(p, y), task
        assert f1_binary(p, y) == ref_f1_binary(p, y), task
    assert 0.0 < abs(matthews_corrcoef(*real["cola"])) < 1.0 and 0.0 < f1_binary(*real["mrpc"]) < 1.0
    for key in ("stsb", "stsb_raw"):
        p, y = real[key]
        assert spearman(p, y) == ref_spearman(p, y), key
        assert 0.3 < spearman(p, y) < 0.9


def test_library_pearson_is_the_old_figure_to_the_last_ulps_and_closer_to_exact(real):
    """SciPy's Pearson differs from the old formula by a few units in the last place (~1e-16) on STS-B: the old
    formula's rounding error. Both round to the same reported figures, and SciPy's is at least as close to the exact
    value (rational arithmetic on the same inputs)."""
    for key in ("stsb", "stsb_raw"):
        p, y = real[key]
        new, old = pearson(p, y), ref_pearson(p, y)
        assert abs(new - old) <= 4 * math.ulp(old), (key, new.hex(), old.hex())
        assert f"{100 * new:.10f}" == f"{100 * old:.10f}"
        exact = exact_pearson(p, y)
        assert abs(Decimal(new) - exact) <= abs(Decimal(old) - exact), key
    scores = [compute_metrics(("pearson", "spearman"), *real[k]) for k in ("stsb", "stsb_raw")]
    refs = [{"pearson": ref_pearson(*real[k]), "spearman": ref_spearman(*real[k])} for k in ("stsb", "stsb_raw")]
    assert f"{100 * task_score({'STS-B': scores[0]}):.2f}" == f"{100 * task_score({'STS-B': refs[0]}):.2f}"


@pytest.mark.parametrize("preds,labels", [
    ([1, 1, 1, 1], [1, 1, 1, 1]),  # all one class, all right
    ([0, 0, 0, 0], [0, 0, 0, 0]),  # all the negative class: no positive anywhere
    ([1, 1, 1, 1], [0, 1, 1, 0]),  # constant predictions
    ([0, 0, 0], [0, 1, 1]),
    ([0, 1, 0], [1, 1, 1]),  # constant labels
    ([1], [1]), ([0], [1]),  # one row
    ([0, 1, 2, 2, 1], [2, 1, 0, 2, 2]),  # three classes (MCC is multiclass)
])
def test_degenerate_classification_keeps_the_old_figures_and_never_warns(preds, labels):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert matthews_corrcoef(preds, labels) == ref_matthews_corrcoef(preds, labels)
        assert accuracy(preds, labels) == ref_accuracy(preds, labels)
        if max(preds + labels) <= 1:
            assert f1_binary(preds, labels) == ref_f1_binary(preds, labels)
    if len(set(preds)) == 1 or len(set(labels)) == 1:
        assert matthews_corrcoef(preds, labels) == 0.0  # undefined: 0.0, not NaN


@pytest.mark.parametrize("x,y", [
    ([2.0, 2.0, 2.0], [1.0, 2.0, 3.0]),  # constant predictions: undefined
    ([1.0, 2.0, 3.0], [4.0, 4.0, 4.0]),  # constant labels
    ([3.0, 3.0], [3.0, 3.0]),
    ([1.5], [2.0]),  # one row
    ([], []),
])
def test_undefined_correlations_are_zero_as_before_and_never_warn(x, y):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = pearson(x, y), spearman(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the old formulas warned on no rows ("mean of empty slice")
        assert got == (ref_pearson(x, y), ref_spearman(x, y) if x else 0.0) == (0.0, 0.0)


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
