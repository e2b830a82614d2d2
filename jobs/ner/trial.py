"""What CoNLL NER brings to the fine-tuning engine (jobs/tuning/loop.py): first-WordPiece labels (IOB2), a tag
head on every token, a tag per word from its first piece, conlleval's entity P/R/F1 against the eval file's own
tags."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bertpipe.jobs.tuning.conlleval import score
from bertpipe.jobs.tuning.conll import Sentence, to_iob2
from bertpipe.jobs.tuning.loop import Evaluation, length_order, pad_rows, subsample_index
from bertpipe.jobs.tuning.words import Rows, build_rows
from bertpipe.model.bert import IGNORE_INDEX


@dataclass
class NerData:
    train: list[Sentence]
    eval: list[Sentence]
    labels: tuple[str, ...]  # IOB2 label set of the model


def _inputs(rows: Rows, index, device: str) -> dict[str, torch.Tensor]:
    ids = pad_rows([rows.input_ids[r] for r in index])
    return {"input_ids": ids.to(device), "token_type_ids": torch.zeros_like(ids).to(device),
            "attention_mask": pad_rows([[1] * len(rows.input_ids[r]) for r in index]).to(device)}


def predict_tags(model, rows: Rows, num_sentences: int, labels: tuple[str, ...], batch_size: int,
                 device: str) -> list[list[str]]:
    """A tag per word (from its first piece), rows of one sentence joined back in order (the caller holds
    no_grad)."""
    per_row: list[list[str]] = [[] for _ in range(len(rows))]
    order = length_order(rows.input_ids)
    for k in range(0, len(order), batch_size):
        index = order[k:k + batch_size]
        best = model(**_inputs(rows, index, device)).logits.argmax(-1).cpu().numpy()
        for j, r in enumerate(index):
            per_row[r] = [labels[best[j, p]] for p in rows.first_piece[r]]
    out: list[list[str]] = [[] for _ in range(num_sentences)]
    for r, s in enumerate(rows.sentence):
        out[s] += per_row[r]
    return out


class NerTask:
    """CoNLL NER's data and rules, as the trial loop wants them. Score: entity F1 in [0, 1]."""

    truncate = False  # long sentences are cut into rows at word boundaries here

    def __init__(self, data: NerData):
        self.data = data
        self.label_names = tuple(data.labels)

    def build_model(self, model_dir: str, config_overrides: dict | None):
        from bertpipe.model import BertForTokenClassification, load_pretrained

        return load_pretrained(model_dir, BertForTokenClassification, num_labels=len(self.data.labels),
                               config_overrides=config_overrides)

    def train_rows(self, tok, rng: np.random.Generator, recipe) -> Rows:
        pick = subsample_index(len(self.data.train), recipe.max_train_examples, rng)
        train = self.data.train if pick is None else [self.data.train[i] for i in pick]
        label_id = {name: i for i, name in enumerate(self.data.labels)}
        return build_rows(tok, [s.words for s in train], [[label_id[t] for t in to_iob2(s.tags)] for s in train],
                          recipe.max_seq_length)

    def batch(self, rows: Rows, index, device: str) -> dict[str, torch.Tensor]:
        labels = pad_rows([rows.labels[r] for r in index], fill=IGNORE_INDEX).to(device)
        return {**_inputs(rows, index, device), "labels": labels}

    def evaluate(self, model, tok, recipe) -> Evaluation:
        rows = build_rows(tok, [s.words for s in self.data.eval], None, recipe.max_seq_length)
        predicted = predict_tags(model, rows, len(self.data.eval), self.data.labels, recipe.eval_batch_size,
                                 recipe.device)
        metrics = score([s.tags for s in self.data.eval], predicted)
        return Evaluation(metrics["f1"], metrics, {"predicted": predicted})

    def finish(self, model, tok, recipe) -> dict[str, Any]:
        return {}
