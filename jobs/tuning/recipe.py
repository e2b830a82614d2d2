"""The fine-tuning recipe every task shares (GLUE, SQuAD, NER): one frozen dataclass, checked once. Each task's
config extends it with what is its own (data files, task options) and names its YAML section in `SECTION`.

Defaults are the BERT paper's fine-tuning recipe (section 4 and appendix A.3): batch 32, a few epochs, a
learning rate picked on dev among a small grid; warmup 10% and weight decay 0.01 as in google-research/bert.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from bertpipe.pipeline.framework.config_fields import at_least, one_of, path_field, sequence_length, within

SELECT = ("last", "best")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    SECTION: ClassVar[str] = ""  # the config section errors name (glue, squad, ner)

    # A Hugging Face-layout BERT folder (config.json, vocab.txt, model.safetensors) to start from; any URI.
    # Empty: the pre-training export, <pretrain output>/export.
    init: str = path_field()
    learning_rates: tuple[float, ...] = (5e-5, 3e-5)
    # One trial per (learning rate, seed); each trial's RNG seed also mixes in the workflow seed.
    seeds: tuple[int, ...] = (1,)
    batch_size: int = 32
    eval_batch_size: int = 64
    num_epochs: int = 2
    # Linear warmup over this fraction of the steps (factor step/warmup: 0 at the first step, as run_classifier
    # and transformers' get_linear_schedule_with_warmup), then linear decay to 0.
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
    # Seeded subsample of the training examples (0 = all): for smoke runs and CPU benchmarks.
    max_train_examples: int = 0
    # Evaluate after every epoch (curves in MLflow); False: only after the last.
    eval_each_epoch: bool = True
    # Which epoch's model a trial reports and keeps: the last (as transformers' Trainer), or the one with the best
    # dev score (needs eval_each_epoch; the report names the epoch).
    select: str = "last"
    # auto: bf16 autocast when the trial has a GPU, fp32 on CPU. bf16 on a CPU works (slowly): for tests.
    precision: str = "auto"
    # Ray resources per trial (torch uses cpus_per_trial threads); at most max_concurrent_trials at once (0 = all).
    cpus_per_trial: int = 1
    gpus_per_trial: float = 0.0
    max_concurrent_trials: int = 0

    def __post_init__(self) -> None:
        section = self.SECTION
        at_least(section, self, 1, "batch_size", "eval_batch_size", "num_epochs", "cpus_per_trial")
        at_least(section, self, 0, "max_train_examples", "max_concurrent_trials", "gpus_per_trial", "weight_decay")
        if not self.learning_rates or any(lr <= 0 for lr in self.learning_rates):
            raise ValueError(f"{section}.learning_rates must be positive and non-empty, got {self.learning_rates}")
        if not self.seeds or any(not 0 <= seed < 2**32 for seed in self.seeds):
            raise ValueError(f"{section}.seeds must name at least one seed, each in [0, 2**32), got {list(self.seeds)}")
        within(section, self, "warmup_proportion", 0.0, 1.0, high_open=True)
        if self.dropout is not None:
            within(section, self, "dropout", 0.0, 1.0, high_open=True)
        sequence_length(section, self)
        # A zero epsilon divides by zero on a parameter whose gradient is zero; a zero norm zeroes every update.
        for name in ("adam_epsilon", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{section}.{name} must be > 0, got {getattr(self, name)}")
        one_of(section, self, "select", SELECT)
        one_of(section, self, "precision", PRECISIONS)
        if self.select == "best" and not self.eval_each_epoch:
            raise ValueError(f"{section}.select best picks the best epoch on dev: it needs "
                             f"{section}.eval_each_epoch true")

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_trial > 0 else "cpu"

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16" or (self.precision == "auto" and self.device == "cuda")
