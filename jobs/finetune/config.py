"""Typed config of the `finetune` stage (GLUE fan-out). Frozen, keyword-only: YAML and `--set` fill it.

Defaults follow the BERT paper's GLUE recipe (section 4.1): batch 32, 3 epochs, learning rate picked on dev
from {5e-5, 4e-5, 3e-5, 2e-5}; warmup 10% and weight decay 0.01 as in google-research/bert run_classifier.
"""
from __future__ import annotations

from dataclasses import dataclass

from bertpipe.pipeline.config import path_field


@dataclass(frozen=True, kw_only=True)
class FinetuneConfig:
    # Folder holding one sub-folder per task (CoLA/, SST-2/, MNLI/...) in the official GLUE TSV layout; any
    # smart_open URI. Empty: the project's small smoke sample (NOT GLUE), written into the stage output.
    glue_data_dir: str = path_field()
    # Tasks to run. Empty: all nine, whichever are present (the rest are reported absent). Named explicitly:
    # a missing task folder is a failure of that task.
    tasks: tuple[str, ...] = ()
    # A Hugging Face-layout BERT folder (config.json, model.safetensors, vocab.txt) to start from.
    # Empty: the pre-training export, <pretrain output>/export.
    init: str = path_field()
    learning_rates: tuple[float, ...] = (5e-5, 4e-5, 3e-5, 2e-5)
    # One trial per (task, learning rate, seed); each trial's RNG seed also mixes in the workflow seed.
    seeds: tuple[int, ...] = (1,)
    batch_size: int = 32
    eval_batch_size: int = 64
    num_epochs: int = 3
    warmup_proportion: float = 0.1
    weight_decay: float = 0.01
    # google-research/bert uses 1e-6 (its AdamWeightDecayOptimizer); torch's 1e-8 default barely differs.
    adam_epsilon: float = 1e-6
    max_grad_norm: float = 1.0
    max_seq_length: int = 128
    # Dropout (hidden and attention probabilities) while fine-tuning; null = the checkpoint's config.json value.
    # An export of a pre-training run without dropout (the `mini` preset) otherwise fine-tunes without it too;
    # BERT fine-tunes at 0.1.
    dropout: float | None = None
    # Evaluate dev after every epoch (curves in MLflow); False: only after the last, whose score is the trial's
    # either way.
    eval_each_epoch: bool = True
    # Subsample each train set to at most this many examples (seeded); 0 = all. For smoke runs on big tasks.
    max_train_examples: int = 0
    # Ray resources per trial; torch uses cpus_per_trial threads inside a trial.
    cpus_per_trial: int = 1
    gpus_per_trial: float = 0.0
    # At most this many trials run at once; 0 = as many as the cluster's resources fit.
    max_concurrent_trials: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "eval_batch_size", "num_epochs", "max_seq_length", "cpus_per_trial"):
            if getattr(self, name) < 1:
                raise ValueError(f"finetune.{name} must be >= 1, got {getattr(self, name)}")
        if not self.learning_rates or any(lr <= 0 for lr in self.learning_rates):
            raise ValueError(f"finetune.learning_rates must be positive and non-empty, got {self.learning_rates}")
        if not self.seeds or any(not 0 <= seed < 2**32 for seed in self.seeds):
            raise ValueError(f"finetune.seeds must name at least one seed, each in [0, 2**32), got {list(self.seeds)}")
        if not 0.0 <= self.warmup_proportion < 1.0:
            raise ValueError(f"finetune.warmup_proportion must be in [0, 1), got {self.warmup_proportion}")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"finetune.dropout must be in [0, 1) or null, got {self.dropout}")
        if not 8 <= self.max_seq_length <= 512:  # 512: BERT's position table
            raise ValueError(f"finetune.max_seq_length must be in [8, 512], got {self.max_seq_length}")
        # A zero epsilon divides by zero on a parameter whose gradient is zero; a zero norm zeroes every update.
        for name in ("adam_epsilon", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"finetune.{name} must be > 0, got {getattr(self, name)}")
        from bertpipe.jobs.finetune.glue_tasks import get_task

        for task in self.tasks:
            get_task(task)  # unknown name → ValueError listing the nine
        for name in ("max_train_examples", "max_concurrent_trials", "gpus_per_trial", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"finetune.{name} must be >= 0, got {getattr(self, name)}")
