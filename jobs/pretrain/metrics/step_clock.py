"""One worker's clock: what its training costs, measured at the points the loop marks, and what it reports.

The loop marks a phase's start, a data stream's first batch, each micro-batch, each optimizer step, and the time
it sets aside for an evaluation, a checkpoint or a compile. From these the clock keeps

- the step time of each phase with everything set aside left out, and the price of each event still to come (the
  last stream start, evaluation and checkpoint): what the ETA (eta.py) is computed from, on rank 0 at every
  optimizer step, and sent to the driver's progress line;
- the logging window's figures (meter.py: losses, accuracies, throughput), with evaluations and checkpoints left
  out of its elapsed time.

Every time is `time.perf_counter()` on the host (or the `now` given, in tests): nothing here reads the device.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from functools import cached_property
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from bertpipe.jobs.pretrain.metrics import eta
from bertpipe.jobs.pretrain.config import ModelConfig, bert_config
from bertpipe.jobs.pretrain.metrics.meter import Meter
from bertpipe.jobs.pretrain.worker_spec import WorkerSpec

# What the loop may set time aside for; evaluations and checkpoints also leave the logging window's elapsed time
# (a compile is the first window's, which logs no throughput: Meter.steady).
ASIDE = ("compile", "evaluation", "checkpoint")


@dataclass
class Lap:
    """The seconds one block set aside took (known when it ends)."""

    seconds: float = 0.0


class StepClock:
    def __init__(self, spec: WorkerSpec, rank: int, world: int, device, now: Callable[[], float] = time.perf_counter):
        self.spec, self.rank, self.world, self.device, self.now = spec, rank, world, device, now
        self.measured = eta.Clock()  # what the ETA is computed from
        self.meter = Meter(device)  # the logging window's figures; each phase starts its own (start_phase)
        self._last_step: float | None = None  # when the last optimizer step ended (or training started)
        self._aside = 0.0  # seconds since then that the ETA prices apart

    def start_phase(self, phase_index: int) -> None:
        """A phase begins: a new logging window with the phase's FLOPs per batch; the first step of the run is timed
        from here."""
        phase = self.spec.pretrain.phases[phase_index]
        if self._last_step is None:
            self._last_step = self.now()
        self.meter = Meter(self.device, flops_counter(self.spec.model, len(self.spec.vocab_tokens),
                                                      phase.max_predictions_per_seq, self.spec.init_config),
                           device_peak_tflops(self.device))

    def stream_opened(self, seconds: float, before_training: bool) -> None:
        """A data stream's first batch took `seconds` (Ray Data starts an execution for each): the price of every
        stream still to open. Streams opened before training, at once, count by the slowest; one opened between two
        steps is left out of that step's time."""
        if before_training:
            self.measured.stream_start_s = max(self.measured.stream_start_s or 0.0, seconds)
        else:
            self.measured.stream_start_s = seconds
            self._aside += seconds

    @contextmanager
    def aside(self, what: str, phase: int = 0) -> Iterator[Lap]:
        """Time the block as `what` (ASIDE), left out of the step time; an evaluation (of `phase`) or a checkpoint
        becomes the price of the next one, and leaves the logging window's throughput."""
        assert what in ASIDE, what
        lap, started = Lap(), self.now()
        yield lap
        lap.seconds = took = self.now() - started
        self._aside += took
        if what == "evaluation":
            self.measured.eval_s[phase] = took
        elif what == "checkpoint":
            self.measured.checkpoint_s = took
        if what != "compile":
            self.meter.pause(took)

    def micro_batch(self, out, attention_mask: torch.Tensor, wait: float) -> None:
        """One micro-batch trained: its figures into the window (`wait`: host seconds spent getting it)."""
        self.meter.add(out, attention_mask, wait)

    def optimizer_step(self, step: int, phase: int, grad_norm, last: dict) -> None:
        """Optimizer step `step` (of phase `phase`) ended: its health and its time are kept, and rank 0 reports the
        step, the last window's figures (`last`) and the seconds left."""
        self.meter.end_step(step, grad_norm)
        now = self.now()
        if self._last_step is not None:
            self.measured.step(phase, max(now - self._last_step - self._aside, 0.0))
        self._last_step, self._aside = now, 0.0
        if self.rank == 0:
            left = eta.seconds_left(self.schedule, self.measured, step, phase)
            # The last window's figures: reading this step's loss would wait for the device.
            self.spec.progress.set(step, loss=last.get("loss"), seq_s=last.get("sequences_per_second", 0.0),
                                   doing="", eta_s=left, eta_at=time.time())

    @cached_property
    def schedule(self) -> eta.Schedule:
        """The run's schedule, fixed for its life: made once, not at every step."""
        cfg, rows = self.spec.pretrain, self.spec.rows
        per_worker = {k: v // self.world for k, v in rows.items()}
        return eta.Schedule(cfg, self.spec.model, len(self.spec.vocab_tokens), self.world,
                            {q: per_worker.get(f"train_{p.max_seq_length}", 0) for q, p in enumerate(cfg.phases)},
                            {q: per_worker.get(f"heldout_{p.max_seq_length}", 0) for q, p in enumerate(cfg.phases)},
                            self.spec.init_config)


def flops_counter(model_cfg: ModelConfig, vocab_size: int, masked: int, init_config: dict | None = None):
    """Useful FLOPs of a micro-batch of shape (batch, seq) of this model (model/flops.py), for the meter."""
    from bertpipe.model.flops import step_flops

    bert_cfg = bert_config(model_cfg, vocab_size, init_config)
    return lambda batch, seq: step_flops(bert_cfg, batch, seq, masked)


def device_peak_tflops(device) -> float | None:
    """The GPU's dense bf16 peak from its name (None on a CPU or an unknown card: no utilisation is logged)."""
    if getattr(device, "type", str(device)) != "cuda":
        return None
    from bertpipe.model.flops import peak_tflops

    return peak_tflops(torch.cuda.get_device_name(device))
