"""What GLUE brings to the fine-tuning engine (jobs/tuning/loop.py), for any task of the table: sentence (pair)
encoding, a fresh linear head on the pooled [CLS] vector, the task's dev metrics and its test predictions.

The recipe is google-research/bert run_classifier's: [CLS] A [SEP] B [SEP] truncated longest-first at
max_seq_length, the pooled [CLS] vector into a fresh linear head. Batches are padded to the longest row rounded
up to a multiple of 8 (not to max_seq_length): short GLUE sentences would otherwise be mostly padding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bertpipe.jobs.glue.metrics import compute_metrics, task_score
from bertpipe.jobs.glue.tasks import Examples, TaskData
from bertpipe.jobs.tuning.loop import Evaluation, length_order, pad_rows, subsample_index


@dataclass
class Encoded:
    ids: list[list[int]]
    types: list[list[int]]
    labels: np.ndarray | None

    def __len__(self) -> int:
        return len(self.ids)


def encode(tok, examples: Examples) -> Encoded:
    inputs = examples.text_a if examples.text_b is None else list(zip(examples.text_a, examples.text_b))
    encs = tok.encode_batch(inputs)
    return Encoded([e.ids for e in encs], [e.type_ids for e in encs], examples.labels)


def collate(enc: Encoded, rows, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The model inputs of `rows`, padded to the batch's longest rounded up to 8 ([B, T] long tensors), with
    the labels when the rows have them."""
    ids = [enc.ids[i] for i in rows]
    batch = {"input_ids": pad_rows(ids), "token_type_ids": pad_rows([enc.types[i] for i in rows]),
             "attention_mask": pad_rows([[1] * len(r) for r in ids])}
    if enc.labels is not None:
        batch["labels"] = torch.from_numpy(enc.labels[list(rows)])
    return {k: v.to(device) for k, v in batch.items()}


def predict(model, enc: Encoded, batch_size: int, is_regression: bool, device: str) -> np.ndarray:
    """Predicted label ids (or float scores) for every row, in order (the caller holds no_grad and eval mode)."""
    order = length_order(enc.ids)
    out = np.empty(len(enc.ids), dtype=np.float32 if is_regression else np.int64)
    bare = Encoded(enc.ids, enc.types, None)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        logits = model(**collate(bare, rows, device)).logits.float().cpu()
        out[rows] = logits.squeeze(-1).numpy() if is_regression else logits.argmax(-1).numpy()
    return out


class GlueTask:
    """One GLUE task's data and rules, as the trial loop wants them."""

    truncate = True

    def __init__(self, data: TaskData):
        self.data, self.spec = data, data.spec
        self.label_names = None if self.spec.is_regression else tuple(self.spec.labels)

    def build_model(self, model_dir: str, config_overrides: dict | None):
        from bertpipe.model import BertForSequenceClassification, load_pretrained

        return load_pretrained(model_dir, BertForSequenceClassification, num_labels=self.spec.num_labels,
                               config_overrides=config_overrides)

    def train_rows(self, tok, rng: np.random.Generator, recipe) -> Encoded:
        train = self.data.train
        pick = subsample_index(len(train), recipe.max_train_examples, rng)
        return encode(tok, train if pick is None else train.take(pick))

    def batch(self, rows: Encoded, index, device: str) -> dict[str, torch.Tensor]:
        return collate(rows, index, device)

    def evaluate(self, model, tok, recipe) -> Evaluation:
        dev = {name: compute_metrics(self.spec.metrics, predict(model, encode(tok, ex), recipe.eval_batch_size,
                                                                 self.spec.is_regression, recipe.device), ex.labels)
               for name, ex in self.data.dev.items()}
        flat = {f"{name}.{m}": v for name, ms in dev.items() for m, v in ms.items()}
        return Evaluation(task_score(dev), flat, {"dev_metrics": dev})

    def finish(self, model, tok, recipe) -> dict[str, Any]:
        """The test sets' predictions: {name: [index, predictions]} (GLUE's submission files)."""
        out = {}
        for name, ex in self.data.test.items():
            preds = predict(model, encode(tok, ex), recipe.eval_batch_size, self.spec.is_regression, recipe.device)
            out[name] = [list(ex.index or range(len(ex))), preds.tolist()]
        return {"test_predictions": out}
