"""One CoNLL NER fine-tuning trial: first-WordPiece labels -> train (AdamW, warmup/decay) -> a tag per word from
its first piece -> conlleval entity P/R/F1 against the eval file's own tags. Pure torch: no Ray, no MLflow."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from bertpipe.jobs.downstream.training import (load_tokenizer, make_optimizer, pad_rows, seed_everything, step,
                                                 subsample, train_epochs)
from bertpipe.jobs.ner.conll import Sentence, to_iob2
from bertpipe.jobs.ner.conlleval import score
from bertpipe.jobs.ner.features import Rows, build_rows
from bertpipe.model.bert import IGNORE_INDEX
from bertpipe.model.training import dropout_overrides


@dataclass
class NerData:
    train: list[Sentence]
    eval: list[Sentence]
    labels: tuple[str, ...]  # IOB2 label set of the model


@dataclass
class NerResult:
    score: float  # entity F1 in [0, 1]: the selection key
    metrics: dict[str, float]
    predicted: list[list[str]]  # per eval sentence, per word (IOB2)
    history: list[dict[str, float]] = field(default_factory=list)
    train_seconds: float = 0.0
    eval_seconds: float = 0.0


def _inputs(rows: Rows, index, device: str) -> dict[str, torch.Tensor]:
    ids = pad_rows([rows.input_ids[r] for r in index])
    return {"input_ids": ids.to(device), "token_type_ids": torch.zeros_like(ids).to(device),
            "attention_mask": pad_rows([[1] * len(rows.input_ids[r]) for r in index]).to(device)}


def train_epoch(model, rows: Rows, opt, sched, rng, recipe) -> float:
    model.train()
    order = rng.permutation(len(rows))
    losses = []
    for k in range(0, len(order), recipe.batch_size):
        index = order[k:k + recipe.batch_size]
        labels = pad_rows([rows.labels[r] for r in index], fill=IGNORE_INDEX).to(recipe.device)
        loss, _ = model(**_inputs(rows, index, recipe.device), labels=labels)
        losses.append(step(model, loss, opt, sched, recipe.max_grad_norm))
    return float(np.mean(losses))


@torch.no_grad()
def predict_tags(model, rows: Rows, num_sentences: int, labels: tuple[str, ...], batch_size: int,
                 device: str) -> list[list[str]]:
    """A tag per word (from its first piece), rows of one sentence joined back in order."""
    model.eval()
    per_row: list[list[str]] = [[] for _ in range(len(rows))]
    order = np.argsort([len(x) for x in rows.input_ids], kind="stable")
    for k in range(0, len(order), batch_size):
        index = order[k:k + batch_size]
        _, logits = model(**_inputs(rows, index, device))
        best = logits.argmax(-1).cpu().numpy()
        for j, r in enumerate(index):
            per_row[r] = [labels[best[j, p]] for p in rows.first_piece[r]]
    out: list[list[str]] = [[] for _ in range(num_sentences)]
    for r, s in enumerate(rows.sentence):
        out[s] += per_row[r]
    return out


def run_ner_trial(model_dir: str | Path, data: NerData, learning_rate: float, seed: int, recipe,
                  on_epoch: Callable[[int, dict[str, float]], None] | None = None) -> NerResult:
    """Fine-tune the BERT in `model_dir` on data.train with `recipe` (a NerConfig); score data.eval."""
    from bertpipe.model import BertForTokenClassification, load_pretrained

    rng = seed_everything(seed, recipe.cpus_per_trial)
    train = subsample(data.train, recipe.max_train_examples, rng)
    tok = load_tokenizer(model_dir)
    label_id = {name: i for i, name in enumerate(data.labels)}
    train_rows = build_rows(tok, [s.words for s in train], [[label_id[t] for t in to_iob2(s.tags)] for s in train],
                            recipe.max_seq_length)
    model = load_pretrained(model_dir, BertForTokenClassification, num_labels=len(data.labels),
                            config_overrides=dropout_overrides(recipe.dropout)).to(recipe.device)
    opt, sched, _ = make_optimizer(model, recipe, learning_rate, len(train_rows))
    history, train_seconds = train_epochs(train_epoch, model, train_rows, opt, sched, rng, recipe, on_epoch)
    t1 = time.perf_counter()
    eval_rows = build_rows(tok, [s.words for s in data.eval], None, recipe.max_seq_length)
    predicted = predict_tags(model, eval_rows, len(data.eval), data.labels, recipe.eval_batch_size, recipe.device)
    metrics = score([s.tags for s in data.eval], predicted)
    if on_epoch is not None:
        on_epoch(recipe.num_epochs, {k: v for k, v in metrics.items() if "." not in k})
    return NerResult(metrics["f1"], metrics, predicted, history, train_seconds, time.perf_counter() - t1)
