"""Pieces every downstream trial uses: the WordPiece tokenizer of a model folder, AdamW with the BERT schedule,
one optimizer step, and padding a batch of token-id rows."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from bertpipe.model.training import param_groups, round_up, warmup_decay


def load_tokenizer(model_dir: str | Path):
    """The fast WordPiece tokenizer of a model folder (vocab.txt; lowercasing from config.json, default True),
    without truncation or padding: the jobs cut windows themselves and need every offset."""
    from tokenizers import BertWordPieceTokenizer

    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    lowercase = bool(json.loads(config.read_text()).get("do_lower_case", True)) if config.is_file() else True
    tok = BertWordPieceTokenizer(str(model_dir / "vocab.txt"), lowercase=lowercase)
    tok.no_truncation()
    tok.no_padding()
    return tok


def make_optimizer(model: torch.nn.Module, recipe, learning_rate: float, num_examples: int):
    """AdamW (no decay on biases and LayerNorm) with linear warmup then linear decay over every step of the run.
    Returns (optimizer, scheduler, total steps)."""
    total = math.ceil(num_examples / recipe.batch_size) * recipe.num_epochs
    warmup = int(total * recipe.warmup_proportion)
    opt = torch.optim.AdamW(param_groups(model, recipe.weight_decay), lr=learning_rate, eps=recipe.adam_epsilon,
                            fused=recipe.device in ("cpu", "cuda"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_decay(step, total, warmup))
    return opt, sched, total


def step(model: torch.nn.Module, loss: torch.Tensor, opt, sched, max_grad_norm: float) -> float:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    sched.step()
    return float(loss.item())


def pad_rows(rows: list[list[int]], fill: int = 0, multiple: int = 8) -> torch.Tensor:
    """[B, T] long tensor of `rows` padded with `fill` to the longest row, rounded up to `multiple`."""
    width = round_up(max(len(r) for r in rows), multiple)
    out = np.full((len(rows), width), fill, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return torch.from_numpy(out)


def seed_everything(seed: int, threads: int) -> np.random.Generator:
    """torch's global RNG (head init, dropout) and a numpy generator for the data order, from one seed."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    return np.random.default_rng(seed)


def subsample(examples: list, limit: int, rng: np.random.Generator) -> list:
    """At most `limit` examples drawn with `rng`, in their original order (0 = all)."""
    if not limit or len(examples) <= limit:
        return examples
    return [examples[i] for i in np.sort(rng.choice(len(examples), limit, replace=False))]


def train_epochs(train_epoch, model: torch.nn.Module, rows, opt, sched, rng: np.random.Generator, recipe,
                 on_epoch=None) -> tuple[list[dict[str, float]], float]:
    """`recipe.num_epochs` calls of the task's `train_epoch`; (per-epoch history, seconds)."""
    import time

    history, started = [], time.perf_counter()
    for epoch in range(recipe.num_epochs):
        history.append({"train_loss": train_epoch(model, rows, opt, sched, rng, recipe)})
        if on_epoch is not None:
            on_epoch(epoch + 1, history[-1])
    return history, time.perf_counter() - started
