"""One SQuAD fine-tuning trial: features -> train (AdamW, warmup/decay) -> n-best prediction on the eval set ->
official metrics (and, for v2.0, the null threshold tuned on that set). Pure torch: no Ray, no MLflow."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from bertpipe.jobs.downstream.training import (load_tokenizer, make_optimizer, pad_rows, seed_everything, step,
                                                 subsample, train_epochs)
from bertpipe.jobs.squad.data import Example
from bertpipe.jobs.squad.features import Features, build_features
from bertpipe.jobs.squad.metrics import best_null_threshold, evaluate
from bertpipe.jobs.squad.predict import apply_threshold, predict_answers
from bertpipe.model.training import dropout_overrides


@dataclass
class SquadData:
    train: list[Example]
    eval: list[Example]
    version_2: bool


@dataclass
class SquadResult:
    score: float  # F1 in [0, 1] (v2.0: at the tuned threshold): the selection key
    metrics: dict[str, float]
    predictions: dict[str, str]  # qid -> answer text, the official predictions file
    null_margins: dict[str, float] = field(default_factory=dict)  # v2.0: qid -> null score minus best span
    history: list[dict[str, float]] = field(default_factory=list)
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    num_train_features: int = 0


def _batch(feats: Features, rows, device: str) -> dict[str, torch.Tensor]:
    ids = pad_rows([feats.input_ids[r] for r in rows])
    return {"input_ids": ids.to(device), "token_type_ids": pad_rows([feats.token_type_ids[r] for r in rows]).to(device),
            "attention_mask": (pad_rows([[1] * len(feats.input_ids[r]) for r in rows])).to(device)}


@torch.no_grad()
def logits_of(model, feats: Features, batch_size: int, device: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Start and end logits of every window (trimmed to its length), in order."""
    model.eval()
    starts: list[np.ndarray] = [np.empty(0)] * len(feats)
    ends: list[np.ndarray] = [np.empty(0)] * len(feats)
    order = np.argsort([len(x) for x in feats.input_ids], kind="stable")
    for k in range(0, len(order), batch_size):
        rows = order[k:k + batch_size]
        _, s, e = model(**_batch(feats, rows, device))
        s, e = s.float().cpu().numpy(), e.float().cpu().numpy()
        for j, r in enumerate(rows):
            n = len(feats.input_ids[r])
            starts[r], ends[r] = s[j, :n], e[j, :n]
    return starts, ends


def train_epoch(model, feats: Features, opt, sched, rng, recipe) -> float:
    model.train()
    order = rng.permutation(len(feats))
    losses = []
    for k in range(0, len(order), recipe.batch_size):
        rows = order[k:k + recipe.batch_size]
        b = _batch(feats, rows, recipe.device)
        loss, _, _ = model(**b, start_positions=torch.tensor([feats.start_positions[r] for r in rows],
                                                             device=recipe.device),
                           end_positions=torch.tensor([feats.end_positions[r] for r in rows], device=recipe.device))
        losses.append(step(model, loss, opt, sched, recipe.max_grad_norm))
    return float(np.mean(losses))


def score_predictions(data: SquadData, texts: dict[str, str], margins: dict[str, float]):
    """(metrics, official predictions): v2.0 answers "" above the null threshold that maximises F1 here."""
    gold = {e.qid: [a.text for a in e.answers] for e in data.eval}
    if not data.version_2:
        return evaluate(gold, texts), texts
    threshold, _ = best_null_threshold(gold, texts, margins)
    predictions = apply_threshold(texts, margins, threshold)
    return {**evaluate(gold, predictions, version_2=True), "null_threshold": threshold}, predictions


def run_squad_trial(model_dir: str | Path, data: SquadData, learning_rate: float, seed: int, recipe,
                    on_epoch: Callable[[int, dict[str, float]], None] | None = None) -> SquadResult:
    """Fine-tune the BERT in `model_dir` on data.train with `recipe` (a SquadConfig) and score data.eval."""
    from bertpipe.model import BertForQuestionAnswering, load_pretrained

    rng = seed_everything(seed, recipe.cpus_per_trial)
    train = subsample(data.train, recipe.max_train_examples, rng)
    tok = load_tokenizer(model_dir)
    shape = (recipe.max_seq_length, recipe.doc_stride, recipe.max_query_length)
    train_feats = build_features(tok, train, *shape, labelled=True)
    model = load_pretrained(model_dir, BertForQuestionAnswering,
                            config_overrides=dropout_overrides(recipe.dropout)).to(recipe.device)
    opt, sched, _ = make_optimizer(model, recipe, learning_rate, len(train_feats))
    history, train_seconds = train_epochs(train_epoch, model, train_feats, opt, sched, rng, recipe, on_epoch)
    t1 = time.perf_counter()
    eval_feats = build_features(tok, data.eval, *shape, labelled=False)
    starts, ends = logits_of(model, eval_feats, recipe.eval_batch_size, recipe.device)
    texts, margins = predict_answers(data.eval, eval_feats, starts, ends, recipe.n_best_size,
                                     recipe.max_answer_length)
    metrics, predictions = score_predictions(data, texts, margins)
    if on_epoch is not None:
        on_epoch(recipe.num_epochs, metrics)
    return SquadResult(metrics["f1"], metrics, predictions, margins if data.version_2 else {}, history,
                       train_seconds, time.perf_counter() - t1, len(train_feats))
