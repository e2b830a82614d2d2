"""A pre-training worker as named parts, as torchtitan's trainer has them: the driver's spec, the DeepSpeed engine
and its LR scheduler (engine/build.py), the data (data/streams.py), the running numbers (metrics/training_metrics.py)
and the checkpoints (checkpointing/manager.py); and the few operations on a batch every part of the worker shares:
its masking, its copy to the device, the model on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bertpipe.jobs.pretrain.checkpointing.manager import CheckpointManager
from bertpipe.jobs.pretrain.config import PhaseConfig
from bertpipe.jobs.pretrain.data.masking import MaskingSpec
from bertpipe.jobs.pretrain.data.streams import WorkerData
from bertpipe.jobs.pretrain.engine.build import compile_enabled
from bertpipe.jobs.pretrain.metrics.training_metrics import TrainingMetrics
from bertpipe.jobs.pretrain.worker_spec import WorkerSpec
from bertpipe.jobs.services.tracking import RunLogger

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from torch.optim.lr_scheduler import LambdaLR


@dataclass
class Worker:
    spec: WorkerSpec
    engine: DeepSpeedEngine
    scheduler: LambdaLR
    rank: int
    world: int
    device: torch.device
    data: WorkerData
    metrics: TrainingMetrics
    checkpoints: CheckpointManager
    compiled: bool = False  # the first step of a compiled model has run (it compiled)
    eval_compiled: bool = False  # the same for evaluation (eval mode and its batch shape compile apart)
    # A Ray Train worker looks for drained nodes (loop.checkpoint_if_drained); one built outside Ray Train cannot.
    watches_drains: bool = False
    drain_checked_at: float = 0.0  # time.time() of the last look

    @classmethod
    def build(cls, spec: WorkerSpec, engine: DeepSpeedEngine, scheduler: LambdaLR, rank: int, world: int,
              device: torch.device, run: RunLogger, local_rank: int = 0) -> Worker:
        """The worker's parts around its engine; `run`: the MLflow run its metrics go to (rank 0's logs),
        `local_rank`: its rank on its node."""
        metrics = TrainingMetrics(spec, rank, world, device, run)
        return cls(spec, engine, scheduler, rank, world, device, WorkerData(spec, rank, world, metrics), metrics,
                   CheckpointManager(spec, engine, rank, world, local_rank, run))

    def doing(self, what: str) -> None:
        """Tell the driver's progress line what the workers are busy with (shown if it takes a while)."""
        self.metrics.tell(self.engine.global_steps if self.engine is not None else 0, doing=what)


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


# [B, T] inputs whose T is the micro-batch's longest row (data/masking.py pad_batch): it changes from batch to batch.
SEQUENCE_INPUTS = ("input_ids", "token_type_ids", "attention_mask")


def forward(w: Worker, b: dict[str, torch.Tensor]):
    """The model on a batch already on the device (see to_device).

    Compiled, the sequence length is dynamic from the first step: one graph for every length. Left to itself,
    torch.compile specializes the first graph to the first batch's length and compiles a dynamic one at the next
    length; a restart then compiles a static graph for whatever length its first batch has, which the cache the
    run saved beside its checkpoints (checkpointing/compile_cache.py) holds only if that length was the run's first."""
    if compile_enabled(w.spec.pretrain):
        for name in SEQUENCE_INPUTS:
            torch._dynamo.maybe_mark_dynamic(b[name], 1)
    return w.engine(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["masked_positions"],
                    b["masked_lm_labels"], b["next_sentence_label"])
