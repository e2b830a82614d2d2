"""What a pre-training worker holds (the driver's spec, its engine, where it is in the data, its clock) and
the few operations on a batch every part of the worker shares: its masking, its copy to the device, the model on it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bertpipe.jobs.pretrain.metrics.step_clock import StepClock
from bertpipe.jobs.pretrain.config import PhaseConfig
from bertpipe.jobs.pretrain.data.masking import MaskingSpec
from bertpipe.jobs.pretrain.worker_spec import WorkerSpec
from bertpipe.jobs.services.tracking import RunLogger


@dataclass
class Worker:
    spec: WorkerSpec
    engine: Any
    scheduler: Any
    rank: int
    world: int
    device: Any
    run: RunLogger
    compiled: bool = False  # the first step of a compiled model has run (it compiled)
    eval_compiled: bool = False  # the same for evaluation (eval mode and its batch shape compile apart)
    # Logged windows and held-out evaluations, {"step": .., figure: ..}: the curves the driver draws. Saved in every
    # checkpoint, so a resumed run's curves start at step 1 too.
    history: list[dict[str, float]] = field(default_factory=list)
    heldout: dict[int, list] = field(default_factory=dict)  # seq length -> this worker's held-out batches
    opened: dict[tuple[int, int], tuple] = field(default_factory=dict)  # (phase, epoch) -> (first batch, the rest)
    local_rank: int = 0  # its rank on its node: one rank a node converts a checkpoint of another layout
    clock: StepClock = field(init=False)  # step times, the ETA and the throughput (clock.py)

    def __post_init__(self) -> None:
        self.clock = StepClock(self.spec, self.rank, self.world, self.device)

    def doing(self, what: str) -> None:
        """Rank 0 tells the driver's progress line what the workers are busy with (shown if it takes a while)."""
        if self.rank == 0:
            self.spec.progress.set(self.engine.global_steps if self.engine is not None else 0, doing=what)


def seed_of(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def masking_spec(w: Worker, phase: PhaseConfig, training: bool = True) -> MaskingSpec:
    """The phase's masking as configured, or (training=False) BERT's standard token-level 15% for the final
    evaluation, so runs with other masking settings are compared on the same task."""
    cfg = w.spec.pretrain
    if not training:
        return MaskingSpec.from_vocab(w.spec.vocab_tokens, max_seq_length=phase.max_seq_length,
                                      max_predictions=phase.max_predictions_per_seq)
    return MaskingSpec.from_vocab(w.spec.vocab_tokens, max_seq_length=phase.max_seq_length,
                                  max_predictions=phase.max_predictions_per_seq, masked_lm_prob=cfg.masked_lm_prob,
                                  whole_word=cfg.whole_word_masking)


def to_device(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """Host batch → device. On a GPU through pinned memory, so the copy is asynchronous and queues behind the
    running step instead of making the host wait for it."""
    if getattr(device, "type", str(device)) == "cuda":
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}


def forward(w: Worker, b: dict[str, torch.Tensor]):
    """The model on a batch already on the device (see to_device)."""
    return w.engine(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["masked_positions"],
                    b["masked_lm_labels"], b["next_sentence_label"])
