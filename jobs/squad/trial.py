"""What SQuAD brings to the fine-tuning engine (jobs/tuning/loop.py): question/context windows, a span head,
n-best prediction on the eval set scored with the official metrics (and, for v2.0, the null threshold tuned on
that set)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bertpipe.jobs.squad.data import Example
from bertpipe.jobs.squad.features import Features, build_features
from bertpipe.jobs.squad.metrics import best_null_threshold, squad_scores
from bertpipe.jobs.squad.predict import apply_threshold, predict_answers
from bertpipe.jobs.tuning.loop import Evaluation, length_order, pad_rows, subsample_index


@dataclass
class SquadData:
    train: list[Example]
    eval: list[Example]
    version_2: bool


def _inputs(feats: Features, rows, device: str) -> dict[str, torch.Tensor]:
    ids = [feats.input_ids[r] for r in rows]
    return {"input_ids": pad_rows(ids).to(device),
            "token_type_ids": pad_rows([feats.token_type_ids[r] for r in rows]).to(device),
            "attention_mask": pad_rows([[1] * len(r) for r in ids]).to(device)}


def logits_of(model, feats: Features, batch_size: int, device: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Start and end logits of every window (trimmed to its length), in order (the caller holds no_grad)."""
    starts: list[np.ndarray] = [np.empty(0)] * len(feats)
    ends: list[np.ndarray] = [np.empty(0)] * len(feats)
    order = length_order(feats.input_ids)
    for k in range(0, len(order), batch_size):
        rows = order[k:k + batch_size]
        out = model(**_inputs(feats, rows, device))
        s, e = out.start_logits.float().cpu().numpy(), out.end_logits.float().cpu().numpy()
        for j, r in enumerate(rows):
            n = len(feats.input_ids[r])
            starts[r], ends[r] = s[j, :n], e[j, :n]
    return starts, ends


def score_predictions(data: SquadData, texts: dict[str, str], margins: dict[str, float]):
    """(metrics, official predictions): v2.0 answers "" above the null threshold that maximises F1 here."""
    gold = {e.qid: [a.text for a in e.answers] for e in data.eval}
    if not data.version_2:
        return squad_scores(gold, texts), texts
    threshold, _ = best_null_threshold(gold, texts, margins)
    predictions = apply_threshold(texts, margins, threshold)
    return {**squad_scores(gold, predictions, version_2=True), "null_threshold": threshold}, predictions


class SquadTask:
    """SQuAD's data and rules, as the trial loop wants them. Score: F1 in [0, 1] (v2.0: at the tuned threshold)."""

    truncate = False  # windows are cut here, with a stride
    label_names = None

    def __init__(self, data: SquadData):
        self.data = data

    def _shape(self, recipe) -> tuple[int, int, int]:
        return recipe.max_seq_length, recipe.doc_stride, recipe.max_query_length

    def build_model(self, model_dir: str, config_overrides: dict | None):
        from bertpipe.model import BertForQuestionAnswering, load_pretrained

        return load_pretrained(model_dir, BertForQuestionAnswering, config_overrides=config_overrides)

    def train_rows(self, tok, rng: np.random.Generator, recipe) -> Features:
        pick = subsample_index(len(self.data.train), recipe.max_train_examples, rng)
        train = self.data.train if pick is None else [self.data.train[i] for i in pick]
        return build_features(tok, train, *self._shape(recipe), labelled=True)

    def batch(self, rows: Features, index, device: str) -> dict[str, torch.Tensor]:
        positions = {name: torch.tensor([getattr(rows, name)[r] for r in index], device=device)
                     for name in ("start_positions", "end_positions")}
        return {**_inputs(rows, index, device), **positions}

    def evaluate(self, model, tok, recipe) -> Evaluation:
        feats = build_features(tok, self.data.eval, *self._shape(recipe), labelled=False)
        starts, ends = logits_of(model, feats, recipe.eval_batch_size, recipe.device)
        texts, margins = predict_answers(self.data.eval, feats, starts, ends, recipe.n_best_size,
                                         recipe.max_answer_length)
        metrics, predictions = score_predictions(self.data, texts, margins)
        outputs: dict[str, Any] = {"predictions": predictions}
        if self.data.version_2:
            outputs["null_margins"] = margins
        return Evaluation(metrics["f1"], metrics, outputs)

    def finish(self, model, tok, recipe) -> dict[str, Any]:
        return {}
