"""One fine-tuning trial, for any task: seed → training rows → model → AdamW with warmup and linear decay →
epochs (evaluated on dev after each) → the selected epoch's model → the task's last outputs. Pure torch: no Ray
and no MLflow (epochs go to `on_epoch`, step progress to `report`).

A task plugs in what is its own (a `TrialTask`): the rows it trains on, one batch of model inputs, the head,
the dev evaluation and the outputs written after training (test predictions). The rest is written once here:
- AdamW without decay on biases and LayerNorm, gradients clipped, the learning rate warmed up linearly with
  the reference's factor step/warmup (0 at the first step, as run_classifier and transformers'
  get_linear_schedule_with_warmup) and decayed linearly to 0 at the last step.
- bf16 autocast for the forward passes when the recipe asks for it (by default where a trial has a GPU).
- The training loss is summed on the device and read when progress is reported (about every REPORT_S seconds)
  and at the end of the epoch, not at every step.
- `select: best` keeps a copy of the weights of the best dev epoch and restores it before the outputs.
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any, Callable, Sized

import numpy as np
import torch

from bertpipe.jobs.tuning.trial_types import Evaluation, TrialResult, TrialTask
from bertpipe.model.training import dropout_overrides, param_groups, round_up, warmup_decay
from bertpipe.pipeline.formats.tokenizer import folder_lowercase, load_tokenizer, tokenizer_files

REPORT_S = 2.0  # at most one progress report (and one host read of the loss) per trial in this many seconds


def seed_everything(seed: int, threads: int) -> np.random.Generator:
    """torch's global RNG (head init, dropout: torch gives modules no generator argument) and a numpy generator
    for the data order, from one seed, in the trial's own process."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    return np.random.default_rng(seed)


def subsample_index(n: int, limit: int, rng: np.random.Generator) -> np.ndarray | None:
    """Sorted indices of at most `limit` of `n` rows drawn with `rng`; None when all are kept (0 = all)."""
    if not limit or n <= limit:
        return None
    return np.sort(rng.choice(n, limit, replace=False))


def pad_rows(rows: list[list[int]], fill: int = 0, multiple: int = 8) -> torch.Tensor:
    """[B, T] long tensor of `rows` padded with `fill` to the longest row, rounded up to `multiple` (not to
    max_seq_length: short sentences would otherwise be mostly padding)."""
    width = round_up(max(len(r) for r in rows), multiple)
    out = np.full((len(rows), width), fill, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return torch.from_numpy(out)


def length_order(rows: list[list[int]]) -> np.ndarray:
    """Row indices sorted by length (stable): evaluation batches with little padding."""
    return np.argsort([len(r) for r in rows], kind="stable")


def optimizer_and_schedule(model: torch.nn.Module, recipe, learning_rate: float, num_rows: int):
    """AdamW (no decay on biases and LayerNorm) with the reference warmup, then linear decay over every step of
    the run. Returns (optimizer, scheduler, total steps)."""
    total = math.ceil(num_rows / recipe.batch_size) * recipe.num_epochs
    warmup = int(total * recipe.warmup_proportion)
    # Fused AdamW: one kernel over all tensors; on CPU measurably cheaper than the foreach default for the 30k-row
    # embedding every step updates.
    opt = torch.optim.AdamW(param_groups(model, recipe.weight_decay), lr=learning_rate, eps=recipe.adam_epsilon,
                            fused=recipe.device in ("cpu", "cuda"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_decay(s, total, warmup, from_zero=True))
    return opt, sched, total


def autocast(recipe):
    """bf16 autocast of the forward pass where the recipe says so; a no-op context otherwise."""
    if not recipe.bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=recipe.device, dtype=torch.bfloat16)


class StepReport:
    """Step progress of one trial, sent at most every REPORT_S seconds (and at each epoch's end) to `report`
    (step, total, epoch, loss, lr: the learning rate of that step); the loss is read from the device only then."""

    def __init__(self, report: Callable[..., None] | None, total: int, epochs: int):
        self.report, self.total, self.epochs, self.step = report, total, epochs, 0
        self.last = time.perf_counter()

    def tick(self, epoch: int, loss_sum: torch.Tensor, count: int, lr: float, force: bool = False) -> None:
        self.step += 0 if force else 1
        now = time.perf_counter()
        if self.report is None or not (force or now - self.last >= REPORT_S):
            return
        self.last = now
        self.report(self.step, total=self.total, epoch=f"{epoch}/{self.epochs}",
                    loss=float(loss_sum.item()) / max(count, 1), lr=lr)


def train_epoch(model: torch.nn.Module, task: TrialTask, rows: Sized, opt, sched, rng: np.random.Generator,
                recipe, progress: StepReport, epoch: int) -> float:
    """One pass over the rows in a fresh random order; the mean training loss."""
    model.train()
    order = rng.permutation(len(rows))
    loss_sum = torch.zeros((), dtype=torch.float64, device=recipe.device)
    count = 0
    for start in range(0, len(order), recipe.batch_size):
        with autocast(recipe):
            loss = model(**task.batch(rows, order[start:start + recipe.batch_size], recipe.device)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        loss_sum += loss.detach()
        count += 1
        progress.tick(epoch, loss_sum, count, lr)
    progress.tick(epoch, loss_sum, count, lr, force=True)
    return float(loss_sum.item()) / max(count, 1)


@torch.no_grad()
def evaluate(model: torch.nn.Module, task: TrialTask, tok, recipe) -> Evaluation:
    model.eval()
    with autocast(recipe):
        return task.evaluate(model, tok, recipe)


@torch.no_grad()
def finish(model: torch.nn.Module, task: TrialTask, tok, recipe) -> dict[str, Any]:
    model.eval()
    with autocast(recipe):
        return task.finish(model, tok, recipe)


def run_trial(model_dir: str | Path, task: TrialTask, learning_rate: float, seed: int, recipe,
              on_epoch: Callable[[int, dict[str, float]], None] | None = None,
              report: Callable[..., None] | None = None, save_dir: str | Path | None = None) -> TrialResult:
    """Fine-tune the BERT in `model_dir` (HF layout) on the task with `recipe`; with `save_dir`, write the
    selected epoch's model there (HF layout, the vocabulary and the task's label names)."""
    rng = seed_everything(seed, recipe.cpus_per_trial)
    tok = load_tokenizer(model_dir, recipe.max_seq_length if task.truncate else None)
    rows = task.train_rows(tok, rng, recipe)
    model = task.build_model(str(model_dir), dropout_overrides(recipe.dropout)).to(recipe.device)
    opt, sched, total = optimizer_and_schedule(model, recipe, learning_rate, len(rows))
    progress = StepReport(report, total, recipe.num_epochs)
    history, chosen, best_state, train_s, eval_s = [], None, None, 0.0, 0.0
    for epoch in range(1, recipe.num_epochs + 1):
        t0 = time.perf_counter()
        row = {"train_loss": train_epoch(model, task, rows, opt, sched, rng, recipe, progress, epoch)}
        t1 = time.perf_counter()
        train_s += t1 - t0
        if recipe.eval_each_epoch or epoch == recipe.num_epochs:
            found = evaluate(model, task, tok, recipe)
            row.update(found.metrics, score=found.score)
            if recipe.select == "last" or chosen is None or found.score > chosen[1].score:
                chosen = (epoch, found)
                if recipe.select == "best" and epoch < recipe.num_epochs:
                    best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
                elif recipe.select == "best":
                    best_state = None  # the last epoch is the best: the model already holds it
        eval_s += time.perf_counter() - t1
        history.append(row)
        if on_epoch is not None:
            on_epoch(epoch, row)
    if best_state is not None:
        model.load_state_dict(best_state)
    epoch, found = chosen
    outputs = {**found.outputs, **finish(model, task, tok, recipe)}
    if save_dir is not None:
        from bertpipe.model import save_pretrained

        save_pretrained(model, save_dir, Path(model_dir) / "vocab.txt", label_names=task.label_names,
                        tokenizer_files=tokenizer_files(folder_lowercase(model_dir),
                                                        model.config.max_position_embeddings))
    return TrialResult(learning_rate, seed, found.score, found.metrics, epoch, history, outputs, len(rows), total,
                       train_s, eval_s, len(rows) * recipe.num_epochs / train_s if train_s > 0 else 0.0)
