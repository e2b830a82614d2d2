"""The official SQuAD metrics: exact match and token F1 after normalisation, maximised over the reference
answers; for v2.0 also the HasAns / NoAns splits and the null-score threshold that maximises F1 on dev.

Normalisation as the official scripts do it: lower case, punctuation removed, the articles a/an/the removed as
words, whitespace collapsed. An unanswerable question's only reference is "" (the empty prediction scores 1).
"""
from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)  # v2.0's rule: both empty = 1 (a correct "no answer"), one empty = 0
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def references(answers: list[str], version_2: bool) -> list[str]:
    """v2.0 drops references that normalise to nothing and scores an unanswerable question against ""."""
    if not version_2:
        return list(answers)
    kept = [a for a in answers if normalize_answer(a)]
    return kept or [""]


def score_question(prediction: str, answers: list[str], version_2: bool) -> tuple[float, float]:
    """(exact match, F1) of one prediction: the best over the references."""
    refs = references(answers, version_2)
    return max(exact_match(prediction, r) for r in refs), max(token_f1(prediction, r) for r in refs)


def squad_scores(gold: dict[str, list[str]], predictions: dict[str, str], version_2: bool = False) -> dict[str, float]:
    """exact_match and f1 in [0, 1] over every question of `gold` (qid -> reference texts, [] = unanswerable);
    a question without a prediction scores 0. v2.0 adds HasAns_/NoAns_ exact and f1 and the counts."""
    em, f1 = {}, {}
    for qid, answers in gold.items():
        em[qid], f1[qid] = score_question(predictions.get(qid, ""), answers, version_2) if qid in predictions \
            else (0.0, 0.0)
    out = _mean(em, f1, list(gold), "")
    out["total"] = float(len(gold))
    if version_2:
        has = [q for q, a in gold.items() if references(a, True) != [""]]
        no = [q for q in gold if q not in set(has)]
        out.update(_mean(em, f1, has, "HasAns_") if has else {})
        out.update(_mean(em, f1, no, "NoAns_") if no else {})
        out["HasAns_total"], out["NoAns_total"] = float(len(has)), float(len(no))
    return out


def _mean(em: dict[str, float], f1: dict[str, float], qids: list[str], prefix: str) -> dict[str, float]:
    n = max(len(qids), 1)
    return {f"{prefix}exact_match": sum(em[q] for q in qids) / n, f"{prefix}f1": sum(f1[q] for q in qids) / n}


def unanswerable(answers: list[str]) -> bool:
    return references(answers, True) == [""]


def best_null_threshold(gold: dict[str, list[str]], best_span: dict[str, str],
                        null_margin: dict[str, float]) -> tuple[float, float]:
    """The threshold t on `null_margin` (null score minus the best span's score) that maximises dev F1 when a
    question is answered "" exactly when its margin exceeds t, as the BERT paper tunes it. Returns (t, F1)."""
    qids = sorted(gold, key=lambda q: null_margin.get(q, 0.0))
    if not qids:
        return 0.0, 0.0
    # t below every margin: every question answered "", so each unanswerable one is right and no other.
    score = float(sum(unanswerable(gold[q]) for q in qids))
    best_t, best = null_margin.get(qids[0], 0.0) - 1.0, score
    for i, q in enumerate(qids):  # t = this margin answers q (and every smaller margin) with its span
        score += score_question(best_span.get(q, ""), gold[q], True)[1] - float(unanswerable(gold[q]))
        tied_next = i + 1 < len(qids) and null_margin.get(qids[i + 1], 0.0) == null_margin.get(q, 0.0)
        if score > best and not tied_next:
            best, best_t = score, null_margin.get(q, 0.0)
    return best_t, best / len(qids)
