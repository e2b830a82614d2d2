"""One GLUE fine-tuning trial, for any task of the table: tokenize → train (AdamW, linear warmup/decay) →
evaluate dev after every epoch → predict test. Pure torch: no Ray, no MLflow (progress goes to `on_epoch`).

The recipe is google-research/bert run_classifier's: [CLS] A [SEP] B [SEP] truncated longest-first, the pooled
[CLS] vector into a fresh linear head, AdamW with weight decay 0.01 except on biases and LayerNorm, gradients
clipped at norm 1.0, learning rate warmed up linearly over the first 10% of steps then decayed linearly to 0.
Batches are padded to the longest row rounded up to a multiple of 8 (not to max_seq_length): short GLUE
sentences would otherwise be mostly padding.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from bertpipe.jobs.finetune.glue_metrics import compute_metrics, task_score
from bertpipe.jobs.finetune.glue_tasks import Examples, TaskData


@dataclass(frozen=True, kw_only=True)
class TrialParams:
    learning_rate: float
    seed: int
    batch_size: int = 32
    eval_batch_size: int = 64
    num_epochs: int = 3
    warmup_proportion: float = 0.1
    weight_decay: float = 0.01
    adam_epsilon: float = 1e-6
    max_grad_norm: float = 1.0
    max_seq_length: int = 128
    max_train_examples: int = 0
    num_threads: int = 1
    device: str = "cpu"


@dataclass
class TrialResult:
    task: str
    learning_rate: float
    seed: int
    dev_metrics: dict[str, dict[str, float]]  # final epoch: dev set name → metric → value in [0, 1]
    score: float  # task score of the final epoch (model selection key)
    history: list[dict[str, float]] = field(default_factory=list)  # per epoch: train_loss, dev metrics, score
    test_predictions: dict[str, tuple[list[str], list]] = field(default_factory=dict)  # name → (index, preds)
    num_train_examples: int = 0
    num_steps: int = 0
    train_seconds: float = 0.0
    examples_per_second: float = 0.0


def load_tokenizer(model_dir: str | Path, max_seq_length: int):
    """WordPiece tokenizer from the model folder's vocab.txt; lowercasing from config.json (default True)."""
    from tokenizers import BertWordPieceTokenizer

    model_dir = Path(model_dir)
    lowercase = True
    config_path = model_dir / "config.json"
    if config_path.is_file():
        lowercase = bool(json.loads(config_path.read_text()).get("do_lower_case", True))
    tok = BertWordPieceTokenizer(str(model_dir / "vocab.txt"), lowercase=lowercase)
    tok.enable_truncation(max_length=max_seq_length, strategy="longest_first")
    tok.no_padding()
    return tok


@dataclass
class Encoded:
    ids: list[list[int]]
    types: list[list[int]]
    labels: np.ndarray | None


def encode(tok, examples: Examples) -> Encoded:
    inputs = examples.text_a if examples.text_b is None else list(zip(examples.text_a, examples.text_b))
    encs = tok.encode_batch(inputs)
    return Encoded([e.ids for e in encs], [e.type_ids for e in encs], examples.labels)


def collate(enc: Encoded, rows, multiple: int = 8) -> dict[str, torch.Tensor]:
    """Pad rows to the batch's longest, rounded up to `multiple`. Returns [B, T] long tensors (+ labels)."""
    T = max(len(enc.ids[i]) for i in rows)
    T = -(-T // multiple) * multiple
    B = len(rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    types = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for j, i in enumerate(rows):
        n = len(enc.ids[i])
        ids[j, :n] = torch.tensor(enc.ids[i])
        types[j, :n] = torch.tensor(enc.types[i])
        mask[j, :n] = 1
    batch = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
    if enc.labels is not None:
        batch["labels"] = torch.from_numpy(enc.labels[list(rows)])
    return batch


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # Biases and LayerNorm weights are not decayed (BERT's AdamWeightDecayOptimizer exclusion list).
        (no_decay if p.ndim == 1 or "LayerNorm" in name or "norm" in name.lower() else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def predict(model, enc: Encoded, batch_size: int, is_regression: bool, device: str) -> np.ndarray:
    """Predicted label ids (or float scores) for every row, in order."""
    model.eval()
    order = np.argsort([len(x) for x in enc.ids], kind="stable")  # length-sorted: less padding at eval
    out = np.empty(len(enc.ids), dtype=np.float32 if is_regression else np.int64)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        b = collate(Encoded(enc.ids, enc.types, None), rows)
        _, logits = model(b["input_ids"].to(device), b["token_type_ids"].to(device), b["attention_mask"].to(device))
        logits = logits.float().cpu()
        out[rows] = logits.squeeze(-1).numpy() if is_regression else logits.argmax(-1).numpy()
    return out


def run_trial(model_dir: str | Path, data: TaskData, p: TrialParams,
              on_epoch: Callable[[int, dict[str, float]], None] | None = None) -> TrialResult:
    """Fine-tune the BERT in `model_dir` (HF layout) on `data` with the hyper-parameters `p`."""
    from bertpipe.model import BertForSequenceClassification, load_pretrained

    torch.set_num_threads(p.num_threads)
    spec = data.spec
    # Head init and dropout draw from torch's global RNG (torch gives modules no generator argument); seeding it
    # here, in the trial's own process, makes a trial reproducible. Data order uses its own generator.
    torch.manual_seed(p.seed)
    rng = np.random.default_rng(p.seed)
    train = data.train
    if p.max_train_examples and len(train) > p.max_train_examples:
        train = train.take(np.sort(rng.choice(len(train), p.max_train_examples, replace=False)))

    tok = load_tokenizer(model_dir, p.max_seq_length)
    train_enc = encode(tok, train)
    dev_enc = {name: encode(tok, ex) for name, ex in data.dev.items()}
    model = load_pretrained(model_dir, BertForSequenceClassification, num_labels=spec.num_labels).to(p.device)

    steps_per_epoch = math.ceil(len(train) / p.batch_size)
    total = steps_per_epoch * p.num_epochs
    warmup = int(total * p.warmup_proportion)
    # Fused AdamW: one kernel over all tensors; on CPU it is measurably cheaper than the foreach default for the
    # 30k-row embedding that every step updates (transformers' Trainer uses it too).
    opt = torch.optim.AdamW(_param_groups(model, p.weight_decay), lr=p.learning_rate, eps=p.adam_epsilon,
                            fused=p.device in ("cpu", "cuda"))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / max(1, warmup) if s < warmup else max(0.0, (total - s) / max(1, total - warmup)))

    history: list[dict[str, float]] = []
    dev_metrics: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    for epoch in range(p.num_epochs):
        model.train()
        order = rng.permutation(len(train))
        loss_sum = 0.0
        for start in range(0, len(order), p.batch_size):
            b = {k: v.to(p.device) for k, v in collate(train_enc, order[start:start + p.batch_size]).items()}
            loss, _ = model(b["input_ids"], b["token_type_ids"], b["attention_mask"], labels=b["labels"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), p.max_grad_norm)
            opt.step()
            sched.step()
            loss_sum += loss.item()
        dev_metrics = {}
        for name, enc in dev_enc.items():
            preds = predict(model, enc, p.eval_batch_size, spec.is_regression, p.device)
            dev_metrics[name] = compute_metrics(spec.metrics, preds, enc.labels)
        row = {"train_loss": loss_sum / steps_per_epoch, "score": task_score(dev_metrics)}
        for name, ms in dev_metrics.items():
            row.update({f"{name}.{m}": v for m, v in ms.items()})
        history.append(row)
        if on_epoch is not None:
            on_epoch(epoch + 1, row)
    seconds = time.perf_counter() - t0

    test_predictions = {}
    for name, ex in data.test.items():
        preds = predict(model, encode(tok, ex), p.eval_batch_size, spec.is_regression, p.device)
        test_predictions[name] = (list(ex.index or range(len(ex))), preds.tolist())
    return TrialResult(spec.name, p.learning_rate, p.seed, dev_metrics, task_score(dev_metrics), history,
                       test_predictions, len(train), total, seconds,
                       len(train) * p.num_epochs / seconds if seconds > 0 else 0.0)
