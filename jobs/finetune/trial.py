"""One GLUE fine-tuning trial, for any task of the table: tokenize → train (AdamW, linear warmup/decay) →
evaluate dev after every epoch → predict test. Pure torch: no Ray, no MLflow (progress goes to `on_epoch`).

The recipe is google-research/bert run_classifier's: [CLS] A [SEP] B [SEP] truncated longest-first, the pooled
[CLS] vector into a fresh linear head, AdamW with weight decay 0.01 except on biases and LayerNorm, gradients
clipped at norm 1.0, learning rate warmed up linearly over the first 10% of steps (factor step/warmup, 0 at
the first step, as run_classifier and transformers' Trainer) then decayed linearly to 0. The reported score is
the last epoch's (no best-epoch pick, as the Trainer's final evaluation).
Batches are padded to the longest row rounded up to a multiple of 8 (not to max_seq_length): short GLUE
sentences would otherwise be mostly padding.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from bertpipe.model.training import dropout_overrides, param_groups, round_up, warmup_decay

from bertpipe.jobs.finetune.config import FinetuneConfig
from bertpipe.jobs.finetune.glue_metrics import compute_metrics, task_score
from bertpipe.jobs.finetune.glue_tasks import Examples, TaskData


@dataclass(frozen=True, kw_only=True)
class TrialParams:
    """One trial: the sweep's shared recipe (batch size, epochs, warmup...) plus its own learning rate and seed."""

    learning_rate: float
    seed: int
    recipe: FinetuneConfig = field(default_factory=FinetuneConfig)

    @property
    def device(self) -> str:
        return "cuda" if self.recipe.gpus_per_trial > 0 else "cpu"

    @property
    def num_threads(self) -> int:
        return self.recipe.cpus_per_trial


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
    T = round_up(max(len(enc.ids[i]) for i in rows), multiple)
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


@dataclass
class Prepared:
    """A trial's model, optimizer, schedule and encoded data, ready to train."""

    model: torch.nn.Module
    tokenizer: Any
    train_enc: Encoded
    dev_enc: dict[str, Encoded]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    rng: np.random.Generator
    num_train: int
    total_steps: int


def prepare(model_dir: str | Path, data: TaskData, p: TrialParams) -> Prepared:
    from bertpipe.model import BertForSequenceClassification, load_pretrained

    r = p.recipe
    torch.set_num_threads(p.num_threads)
    # Head init and dropout draw from torch's global RNG (torch gives modules no generator argument); seeding it
    # here, in the trial's own process, makes a trial reproducible. Data order uses its own generator.
    torch.manual_seed(p.seed)
    rng = np.random.default_rng(p.seed)
    train = data.train
    if r.max_train_examples and len(train) > r.max_train_examples:
        train = train.take(np.sort(rng.choice(len(train), r.max_train_examples, replace=False)))
    tok = load_tokenizer(model_dir, r.max_seq_length)
    model = load_pretrained(model_dir, BertForSequenceClassification, num_labels=data.spec.num_labels,
                            config_overrides=dropout_overrides(r.dropout)).to(p.device)
    total = math.ceil(len(train) / r.batch_size) * r.num_epochs
    warmup = int(total * r.warmup_proportion)
    # Fused AdamW: one kernel over all tensors; on CPU it is measurably cheaper than the foreach default for the
    # 30k-row embedding that every step updates (transformers' Trainer uses it too).
    opt = torch.optim.AdamW(param_groups(model, r.weight_decay), lr=p.learning_rate, eps=r.adam_epsilon,
                            fused=p.device in ("cpu", "cuda"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_decay(step, total, warmup, from_zero=True))
    return Prepared(model, tok, encode(tok, train), {n: encode(tok, ex) for n, ex in data.dev.items()}, opt, sched,
                    rng, len(train), total)


def train_epoch(t: Prepared, p: TrialParams) -> float:
    """One pass over the training set in a fresh random order; returns the mean training loss."""
    t.model.train()
    order = t.rng.permutation(t.num_train)
    losses = []
    for start in range(0, len(order), p.recipe.batch_size):
        b = {k: v.to(p.device) for k, v in collate(t.train_enc, order[start:start + p.recipe.batch_size]).items()}
        loss, _ = t.model(b["input_ids"], b["token_type_ids"], b["attention_mask"], labels=b["labels"])
        t.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(t.model.parameters(), p.recipe.max_grad_norm)
        t.optimizer.step()
        t.scheduler.step()
        losses.append(loss.item())
    return float(np.mean(losses))


def evaluate_dev(t: Prepared, spec, p: TrialParams) -> dict[str, dict[str, float]]:
    return {name: compute_metrics(spec.metrics, predict(t.model, enc, p.recipe.eval_batch_size, spec.is_regression,
                                                        p.device), enc.labels)
            for name, enc in t.dev_enc.items()}


def run_trial(model_dir: str | Path, data: TaskData, p: TrialParams,
              on_epoch: Callable[[int, dict[str, float]], None] | None = None,
              save_dir: str | Path | None = None) -> TrialResult:
    """Fine-tune the BERT in `model_dir` (HF layout) on `data` with the hyper-parameters `p`; with `save_dir`,
    write the fine-tuned model there (HF layout, with the vocabulary)."""
    spec = data.spec
    t = prepare(model_dir, data, p)
    history: list[dict[str, float]] = []
    dev_metrics: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    for epoch in range(p.recipe.num_epochs):
        row = {"train_loss": train_epoch(t, p)}
        if p.recipe.eval_each_epoch or epoch == p.recipe.num_epochs - 1:
            dev_metrics = evaluate_dev(t, spec, p)
            row["score"] = task_score(dev_metrics)
            for name, ms in dev_metrics.items():
                row.update({f"{name}.{m}": v for m, v in ms.items()})
        history.append(row)
        if on_epoch is not None:
            on_epoch(epoch + 1, row)
    seconds = time.perf_counter() - t0
    if save_dir is not None:
        from bertpipe.model import save_pretrained

        save_pretrained(t.model, save_dir, Path(model_dir) / "vocab.txt")
    test_predictions = {}
    for name, ex in data.test.items():
        preds = predict(t.model, encode(t.tokenizer, ex), p.recipe.eval_batch_size, spec.is_regression, p.device)
        test_predictions[name] = (list(ex.index or range(len(ex))), preds.tolist())
    return TrialResult(spec.name, p.learning_rate, p.seed, dev_metrics, task_score(dev_metrics), history,
                       test_predictions, t.num_train, t.total_steps, seconds,
                       t.num_train * p.recipe.num_epochs / seconds if seconds > 0 else 0.0)
