"""The types a fine-tuning trial and the fan-out share: what a task gives the trial loop (`TrialTask`), a dev
evaluation and a trial's result. Apart from jobs/tuning/loop.py (torch) so that planning a fan-out, reading kept
trials and `bertpipe status` import no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sized

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclass
class Evaluation:
    score: float  # the selection key, in [0, 1]
    metrics: dict[str, float]  # flat names ("dev.accuracy", "f1")
    outputs: dict[str, Any] = field(default_factory=dict)  # JSON-able: what the stage writes (predictions)


class TrialTask(Protocol):
    """What a task (GLUE, SQuAD, NER) gives the trial loop. It is pickled into each Ray task with its data."""

    truncate: bool  # the tokenizer cuts inputs at max_seq_length (GLUE); False: the task cuts windows itself
    label_names: tuple[str, ...] | None  # written into the fine-tuned model's config.json (id2label)

    def build_model(self, model_dir: str, config_overrides: dict | None) -> torch.nn.Module: ...

    def train_rows(self, tok, rng: np.random.Generator, recipe) -> Sized: ...

    def batch(self, rows, index: np.ndarray, device: str) -> dict[str, torch.Tensor]: ...

    def evaluate(self, model: torch.nn.Module, tok, recipe) -> Evaluation: ...

    def finish(self, model: torch.nn.Module, tok, recipe) -> dict[str, Any]: ...


@dataclass
class TrialResult:
    learning_rate: float
    seed: int  # the trial's RNG seed
    score: float  # the selected epoch's dev score
    metrics: dict[str, float]  # the selected epoch's dev metrics
    epoch: int  # the selected epoch, 1-based
    history: list[dict[str, float]] = field(default_factory=list)  # per epoch: train_loss, dev metrics, score
    outputs: dict[str, Any] = field(default_factory=dict)  # the task's: dev / test predictions
    num_train: int = 0  # training rows (examples, windows or sentence pieces)
    num_steps: int = 0
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    rows_per_second: float = 0.0
