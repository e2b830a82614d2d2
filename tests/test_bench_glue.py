"""The GLUE parity benchmark's reference side: transformers' Trainer, run for real on a model that records the
order it is fed, must draw every trial's data orders independently, as our trial does. With the Trainer's default
seedable sampler (epoch e shuffled with seed + e), consecutive trial seeds share epoch orders, which correlates the
trials and shrinks the reference's spread in the sd comparison."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from bertpipe.jobs.glue.config import GlueConfig

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_glue.py"
N_ROWS, EPOCHS = 12, 3
RECIPE = GlueConfig(batch_size=N_ROWS, num_epochs=EPOCHS)
LR = 1e-3


def bench_glue():
    spec = importlib.util.spec_from_file_location("bench_glue", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class OrderRecorder(torch.nn.Module):
    """Takes one whole-dataset batch per step and remembers the row order it saw."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.orders: list[list[int]] = []

    def forward(self, row, labels=None):
        self.orders.append(row.tolist())
        return {"loss": (self.w * labels.float()).sum()}


def epoch_orders(args) -> list[tuple[int, ...]]:
    model = OrderRecorder()
    rows = [{"row": i, "labels": i % 2} for i in range(N_ROWS)]
    transformers.Trainer(model=model, args=args, train_dataset=rows).train()
    return [tuple(o) for o in model.orders]


def test_trainer_side_draws_distinct_data_orders_for_every_trial_and_epoch(tmp_path):
    bench = bench_glue()
    orders = {seed: epoch_orders(bench.hf_training_args(RECIPE, LR, seed, str(tmp_path / str(seed)), warmup_steps=0))
              for seed in (1, 2, 3)}
    assert all(len(o) == EPOCHS and all(sorted(e) == list(range(N_ROWS)) for e in o) for o in orders.values())
    flat = [e for seed in orders for e in orders[seed]]
    assert len(set(flat)) == len(flat), "two (trial, epoch) pairs were fed the same order"
    # Reproducible: the same trial seed gives the same orders.
    again = epoch_orders(bench.hf_training_args(RECIPE, LR, 2, str(tmp_path / "again"), warmup_steps=0))
    assert again == orders[2]


def test_without_a_data_seed_the_trainer_shares_epoch_orders_across_consecutive_seeds(tmp_path):
    """What the benchmark guards against (and its --hf-shared-orders control reproduces), shown on the installed
    transformers/accelerate: with only `seed` set, trial 2's first epoch is trial 1's second."""
    bench = bench_glue()
    orders = {}
    for seed in (1, 2):
        args = bench.hf_training_args(RECIPE, LR, seed, str(tmp_path / str(seed)), 0, shared_orders=True)
        orders[seed] = epoch_orders(args)
    assert orders[2][0] == orders[1][1] and orders[2][1] == orders[1][2]
