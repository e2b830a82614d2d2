"""One worker's running numbers, in one object the loop marks and reads (torchtitan's metrics processor): what each
step costs, the logging window, the curves, the ETA, and the driver's progress line.

The loop marks a phase's start, a data stream's first batch, each micro-batch, each optimizer step, and the time
it sets aside for an evaluation, a checkpoint or a compile. From these the metrics keep

- the step time of each phase with everything set aside left out, and the price of each event still to come (the
  last stream start, evaluation and checkpoint): what the ETA (eta.py) is computed from, on rank 0 at every
  optimizer step, and sent to the driver's progress line;
- the logging window's figures (meter.py: losses, accuracies, throughput), with evaluations and checkpoints left
  out of its elapsed time, logged to MLflow under the convention's names (tracking.metric_names);
- the history: every logged window's and every evaluation's figures, the curves the driver draws. A checkpoint
  saves it, so a resumed run's curves start at step 1 too;
- where a restarted attempt's start went, closed at its first step (restart.py), and what each checkpoint stalled
  training (checkpoint/stall_s).

Every time is `time.perf_counter()` on the host (or the `now` given, in tests): nothing here reads the device
except the logging window, once per window.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterator

import torch

from bertpipe.jobs.pretrain.config import ModelConfig, bert_config
from bertpipe.jobs.pretrain.metrics import eta, restart
from bertpipe.jobs.pretrain.metrics.meter import TIMED_FIGURES, Meter, NonFiniteError
from bertpipe.jobs.pretrain.metrics.restart import RestartClock
from bertpipe.jobs.pretrain.worker_spec import WorkerSpec
from bertpipe.jobs.services.tracking import CHECKPOINT, RunLogger, metric_names

log = logging.getLogger("bertpipe.pretrain")
# What the loop may set time aside for; evaluations and checkpoints also leave the logging window's elapsed time
# (a compile is the first window's, which logs no throughput: Meter.steady).
ASIDE = ("compile", "evaluation", "checkpoint")
# The training figures of a logging window that go into the curves.
CURVE_KEYS = ("loss", "mlm_loss", "mlm_accuracy", "nsp_accuracy")
STALL_METRIC = f"{CHECKPOINT}stall_s"  # seconds training stood still for a checkpoint, at its step


@dataclass
class Lap:
    """The seconds one block set aside took (known when it ends)."""

    seconds: float = 0.0


class TrainingMetrics:
    def __init__(self, spec: WorkerSpec, rank: int, world: int, device, run: RunLogger,
                 now: Callable[[], float] = time.perf_counter):
        self.spec, self.rank, self.world, self.device, self.run, self.now = spec, rank, world, device, run, now
        self.measured = eta.Measurements()  # what the ETA is computed from
        self.meter = Meter(device)  # the logging window's figures; each phase starts its own (start_phase)
        self.history: list[dict[str, float]] = []  # {"step": .., figure: ..} of every window and evaluation logged
        # The last logged window's figures, its throughput that of the last steady window: what the progress line
        # and a checkpoint's report carry.
        self.last_window: dict[str, float] = {}
        self._last_step: float | None = None  # when the last optimizer step ended (or training started)
        self._aside = 0.0  # seconds since then that the ETA prices apart
        # Where this attempt's start went, to its first step (the worker's set-up gives it its stamp: loop.setup)
        self.restart = RestartClock(None, 0.0)

    def tell(self, step: int, **fields: Any) -> None:
        """Rank 0 tells the driver's progress line (`doing`, a `status` line, the ETA) at optimizer step `step`."""
        if self.rank == 0:
            self.spec.progress.set(step, **fields)

    def attempt_started(self, step: int, accumulation: int) -> None:
        """This attempt resumed at `step` with this worker count and `accumulation` gradient accumulation steps: the
        driver's attempt watch (attempts.py) tells a restart, and a resize, by it."""
        self.tell(step, attempt_started=time.time(), resumed_from=step, eta_s=None, workers=self.world,
                  accumulation=accumulation)

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
        else:
            self.restart.add("compile", took)

    def checkpoint_stall(self, step: int, seconds: float) -> None:
        """Training stood still `seconds` for the step-`step` checkpoint (its files written, its report), logged."""
        self.run.log_metrics({STALL_METRIC: seconds}, step)

    def micro_batch(self, out, attention_mask: torch.Tensor, wait: float) -> None:
        """One micro-batch trained: its figures into the window (`wait`: host seconds spent getting it)."""
        self.meter.add(out, attention_mask, wait)
        self.restart.batch_ready(wait)

    def optimizer_step(self, step: int, phase: int, grad_norm) -> None:
        """Optimizer step `step` (of phase `phase`) ended: its health and its time are kept, and rank 0 reports the
        step, the last window's figures and the seconds left."""
        self.meter.end_step(step, grad_norm)
        now = self.now()
        if self._last_step is not None:
            self.measured.step(phase, max(now - self._last_step - self._aside, 0.0))
        self._last_step, self._aside = now, 0.0
        self.restart_reached(step)
        if self.rank == 0:
            left = eta.seconds_left(self.schedule, self.measured, step, phase)
            # The last window's figures: reading this step's loss would wait for the device.
            # step_at: the driver's rate counts the global batches of the steps over its window (metrics/rate.py)
            self.tell(step, loss=self.last_window.get("loss"), step_at=[step, time.time()], doing="", eta_s=left,
                      eta_at=time.time(), paused=False)

    def restart_reached(self, step: int) -> None:
        """At the attempt's first optimizer step, `step`: where its start went (metrics/restart.py), on rank 0 in
        MLflow and a console line for a restart, in the worker's log for the run's first attempt."""
        breakdown = self.restart.first_step()
        if breakdown is None or self.rank != 0:
            return
        said = restart.line(breakdown, step, self.restart.stamp.attempt, self.restart.compile_note,
                            self.restart.worker_note)
        log.info("pretrain: %s", said)
        if self.restart.is_restart:
            self.run.log_metrics(restart.metric_values(breakdown), step)
            self.tell(step, status=said)

    def log_window(self, step: int, seq_length: int, lr: float, grad_norm) -> dict[str, float]:
        """The window's figures, all-reduced, logged, kept for the curves and returned (`last_window`); the window's
        only host reads; then a new window. The first window of a phase (data start-up, compile, resume:
        Meter.steady) logs no throughput, and the last steady window's throughput stays in `last_window`: no speed is
        reported for it, rather than a wrong one."""
        meter = self.meter
        try:
            figures = meter.summary(self.world)
        except NonFiniteError as exc:
            raise NonFiniteError(f"pretrain (seq {seq_length}): {exc}") from None
        metrics = {**figures, "lr": lr, "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                   "seq_length": seq_length, "world_size": self.world}  # an elastic run's size, step by step
        if not meter.steady:
            metrics = {k: v for k, v in metrics.items() if k not in TIMED_FIGURES}
        self.run.log_metrics(metric_names(metrics), step)
        self.history.append({"step": step, **{k: metrics[k] for k in CURVE_KEYS}})
        self.last_window = {**{k: v for k, v in self.last_window.items() if k in TIMED_FIGURES}, **metrics}
        if self.rank == 0:
            log.info("step %d seq %d loss %.4f mlm_acc %.3f nsp_acc %.3f lr %.2e %.1f seq/s wait %.1f%%%s", step,
                     seq_length, metrics["loss"], metrics["mlm_accuracy"], metrics["nsp_accuracy"], metrics["lr"],
                     figures["sequences_per_second"], 100 * figures["data_wait_fraction"], _utilisation(figures))
        meter.reset()
        return self.last_window

    def log_evaluation(self, step: int, held_out: dict[str, float]) -> None:
        """A held-out evaluation at `step`, logged and kept for the curves."""
        self.run.log_metrics(metric_names(evaluation_series(held_out)), step)
        self.history.append({"step": step, **held_out})

    def final(self, step: int, resumed_from: int, held_out: dict[str, float], **extra: Any) -> dict[str, Any]:
        """The run's final figures after the final evaluation (`held_out`, logged at `step`): the last window's, the
        evaluation's, `extra`, and the whole history. `resumed_from_step`: where this attempt started (a test reads
        it to prove no progress was lost)."""
        final = {"step": step, "resumed_from_step": resumed_from, **self.last_window, **held_out, **extra}
        evaluated = {k: v for k, v in final.items() if k.startswith("eval_")}
        self.run.log_metrics(metric_names(evaluation_series(evaluated)), step)
        final["history"] = [*self.history, {"step": step, **evaluated}]
        return final

    @cached_property
    def schedule(self) -> eta.Schedule:
        """The run's schedule, fixed for its life: made once, not at every step."""
        cfg, rows = self.spec.pretrain, self.spec.rows
        per_worker = {k: v // self.world for k, v in rows.items()}
        return eta.Schedule(cfg, self.spec.model, len(self.spec.vocab_tokens), self.world,
                            {q: per_worker.get(f"train_{p.max_seq_length}", 0) for q, p in enumerate(cfg.phases)},
                            {q: per_worker.get(f"heldout_{p.max_seq_length}", 0) for q, p in enumerate(cfg.phases)},
                            self.spec.init_config)


def evaluation_series(held_out: dict[str, float]) -> dict[str, float]:
    """What of an evaluation is an MLflow series: its accuracies and loss (the count of held-out sequences, the
    same every time, goes into the stage's summary)."""
    return {k: v for k, v in held_out.items() if k != "eval_sequences"}


def _utilisation(figures: dict[str, float]) -> str:
    """The log line's FLOP figures, where the meter has them."""
    said = ""
    if "model_tflops_per_second" in figures:
        said = f" {figures['model_tflops_per_second']:.1f} TFLOP/s per device"
    if "model_flops_utilization" in figures:
        said += f" (MFU {100 * figures['model_flops_utilization']:.1f}%)"
    return said


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
