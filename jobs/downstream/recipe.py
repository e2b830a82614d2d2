"""The fine-tuning recipe the SQuAD and NER stages share (the fields they have in common with GLUE's), with
its checks. Each stage's config subclasses it and adds its own fields.
"""
from __future__ import annotations

from dataclasses import dataclass

from bertpipe.pipeline.config import path_field


@dataclass(frozen=True, kw_only=True)
class Recipe:
    # A Hugging Face-layout BERT folder to start from. Empty: the pre-training export.
    init: str = path_field()
    learning_rates: tuple[float, ...] = (5e-5, 3e-5)
    seeds: tuple[int, ...] = (1,)
    batch_size: int = 32
    eval_batch_size: int = 64
    num_epochs: int = 2
    warmup_proportion: float = 0.1
    weight_decay: float = 0.01
    adam_epsilon: float = 1e-6
    max_grad_norm: float = 1.0
    max_seq_length: int = 128
    # Dropout (hidden and attention probabilities) while fine-tuning; null = the checkpoint's config.json value.
    # An export of a pre-training run without dropout (the `mini` preset) otherwise fine-tunes without it too;
    # BERT fine-tunes at 0.1.
    dropout: float | None = None
    # Seeded subsample of the training examples (0 = all): for smoke runs and CPU benchmarks.
    max_train_examples: int = 0
    # Ray resources per trial (torch uses cpus_per_trial threads); at most max_concurrent_trials at once (0 = all).
    cpus_per_trial: int = 1
    gpus_per_trial: float = 0.0
    max_concurrent_trials: int = 0

    def check(self, section: str) -> None:
        """ValueError naming `section.field` for the first bad value."""
        for name in ("batch_size", "eval_batch_size", "num_epochs", "cpus_per_trial"):
            if getattr(self, name) < 1:
                raise ValueError(f"{section}.{name} must be >= 1, got {getattr(self, name)}")
        if not self.learning_rates or any(lr <= 0 for lr in self.learning_rates):
            raise ValueError(f"{section}.learning_rates must be positive and non-empty, got {self.learning_rates}")
        if not self.seeds or any(not 0 <= seed < 2**32 for seed in self.seeds):
            raise ValueError(f"{section}.seeds must name at least one seed, each in [0, 2**32), got {list(self.seeds)}")
        if not 0.0 <= self.warmup_proportion < 1.0:
            raise ValueError(f"{section}.warmup_proportion must be in [0, 1), got {self.warmup_proportion}")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{section}.dropout must be in [0, 1) or null, got {self.dropout}")
        if not 16 <= self.max_seq_length <= 512:
            raise ValueError(f"{section}.max_seq_length must be in [16, 512], got {self.max_seq_length}")
        for name in ("max_train_examples", "max_concurrent_trials", "gpus_per_trial", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{section}.{name} must be >= 0, got {getattr(self, name)}")
        # A zero epsilon divides by zero on a parameter whose gradient is zero; a zero norm zeroes every update.
        for name in ("adam_epsilon", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{section}.{name} must be > 0, got {getattr(self, name)}")

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_trial > 0 else "cpu"
