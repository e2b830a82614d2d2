"""Running pre-training figures of one logging window, kept on the device and read once per window.

A host read of a device tensor (`.item()`, `float(t)`, `.tolist()`) waits for every kernel queued before it, so one
per micro-batch keeps the CPU from running ahead of the GPU. The meter therefore adds each micro-batch's figures
into a device tensor and the step's health (is the loss, is the global gradient norm finite?) into another; both
cross the host boundary in `summary`, once per logging window, as one all-reduce and one read.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

# What a logging window sums on each worker, by name. On the device: the model's figures and the real-token count.
DEVICE_SUMS = ("loss", "mlm_loss", "nsp_loss", "mlm_correct", "mlm_count", "nsp_correct", "tokens")
# On the host (plain Python numbers, known without the device): padded slots, seconds spent waiting for data and the
# useful model FLOPs of the batches (from their shapes, model/flops.py).
HOST_SUMS = ("sequences", "micro_batches", "slots", "data_wait", "flops")
# The figures measured over the window's elapsed time: what a window that is not steady (Meter.steady) does not log.
TIMED_FIGURES = ("sequences_per_second", "tokens_per_second", "data_wait_fraction", "model_tflops_per_second",
                 "model_flops_utilization")
NO_STEP = -1.0  # "no bad step yet" in the health vector
NONE_SEEN = 2.0**62  # the same, as all-reduced with MIN over ranks


class NonFiniteError(RuntimeError):
    """The loss or the global gradient norm stopped being finite: training further would only spread NaNs."""


def all_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


class Meter:
    """Running figures of one logging window on one worker."""

    def __init__(self, device=None, flops_of: Callable[[int, int], float] | None = None,
                 peak_tflops: float | None = None):
        """`flops_of(batch, seq)`: useful FLOPs of one micro-batch of that shape (None: no FLOP figures);
        `peak_tflops`: one device's peak, for the utilisation (None: not known, no utilisation)."""
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.flops_of, self.peak_tflops = flops_of, peak_tflops
        self.reset()
        # The first window of a meter (one per phase and attempt) holds the phase's start: the data pipeline's
        # start-up, the first step (a compile), a resume's skipped batches. Its speed is no throughput figure.
        self.steady = False

    def reset(self) -> None:
        """Start a new logging window (the health record is kept: a bad step is reported, not forgotten)."""
        self.sums = torch.zeros(len(DEVICE_SUMS), dtype=torch.float64, device=self.device)
        self.host = dict.fromkeys(HOST_SUMS, 0.0)
        self.step_loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if not hasattr(self, "first_bad"):
            # First optimizer step whose loss / gradient norm was not finite, NO_STEP while none was.
            self.first_bad = torch.full((2,), NO_STEP, dtype=torch.float64, device=self.device)
        self.started = time.perf_counter()
        self.paused = 0.0  # seconds of the window spent on anything but training (evaluation, checkpoints)
        self.steady = True

    def pause(self, seconds: float) -> None:
        """Leave `seconds` (an evaluation, a checkpoint) out of the window's elapsed time."""
        self.paused += seconds

    def add(self, out, attention_mask: torch.Tensor, wait: float) -> None:
        """One micro-batch: `out` the model's PreTrainingOutput, `attention_mask` the batch's mask on the device."""
        figures = torch.stack([out.loss.detach().float(), out.mlm_loss.detach().float(),
                               out.nsp_loss.detach().float(), out.mlm_correct.float(), out.mlm_count.float(),
                               out.nsp_correct.float(), attention_mask.sum().float()])
        self.sums += figures
        self.step_loss += figures[0]
        self.host["sequences"] += attention_mask.shape[0]
        self.host["micro_batches"] += 1
        self.host["slots"] += attention_mask.numel()
        self.host["data_wait"] += wait
        if self.flops_of is not None:
            self.host["flops"] += self.flops_of(*attention_mask.shape)

    def end_step(self, step: int, grad_norm) -> None:
        """At an optimizer step: remember it if its summed loss or the global gradient norm is not finite. A norm
        of None (DeepSpeed keeps none at ZeRO 0 in fp32) is not checked."""
        norm = grad_norm if torch.is_tensor(grad_norm) else torch.tensor(0.0 if grad_norm is None else float(grad_norm))
        ok = torch.stack([torch.isfinite(self.step_loss), torch.isfinite(norm.to(self.device).float())])
        self.first_bad = torch.where((self.first_bad == NO_STEP) & ~ok, float(step), self.first_bad)
        self.step_loss = torch.zeros((), dtype=torch.float32, device=self.device)

    def summary(self, world_size: int | None = None) -> dict[str, float]:
        """Window figures over all workers (collectives: every rank calls it at the same step). Raises
        NonFiniteError if any rank saw a non-finite loss or gradient norm since the run started."""
        world = world_size or dist.get_world_size()
        host = torch.tensor([self.host[n] for n in HOST_SUMS], dtype=torch.float64, device=self.device)
        totals = torch.cat([self.sums, host])
        dist.all_reduce(totals)
        # The earliest bad step over ranks; a rank with none offers NONE_SEEN, which every real step beats.
        bad = torch.where(self.first_bad == NO_STEP, NONE_SEEN, self.first_bad)
        dist.all_reduce(bad, op=dist.ReduceOp.MIN)
        values = torch.cat([totals, bad]).tolist()  # the window's one host read
        s = dict(zip(DEVICE_SUMS + HOST_SUMS, values))
        check_finite(values[-2:])
        elapsed = max(time.perf_counter() - self.started - self.paused, 1e-9)
        micro = max(s["micro_batches"], 1.0)
        return {**self._flop_figures(s["flops"] / world / elapsed),
            "loss": s["loss"] / micro, "mlm_loss": s["mlm_loss"] / micro, "nsp_loss": s["nsp_loss"] / micro,
            "mlm_accuracy": s["mlm_correct"] / max(s["mlm_count"], 1),
            "nsp_accuracy": s["nsp_correct"] / max(s["sequences"], 1),
            "sequences_per_second": s["sequences"] / elapsed, "tokens_per_second": s["tokens"] / elapsed,
            "data_wait_fraction": s["data_wait"] / world / elapsed,
            "padding_fraction": 1.0 - s["tokens"] / max(s["slots"], 1.0),
        }

    def _flop_figures(self, flops_per_second: float) -> dict[str, float]:
        """Per device: useful model TFLOP/s, and its share of the device's peak (model FLOPs utilisation)."""
        if self.flops_of is None:
            return {}
        tflops = flops_per_second / 1e12
        figures = {"model_tflops_per_second": tflops}
        if self.peak_tflops:
            figures["model_flops_utilization"] = tflops / self.peak_tflops
        return figures



def check_finite(bad: list[float]) -> None:
    """`bad` = [first step with a non-finite loss, first step with a non-finite gradient norm] (NONE_SEEN = none)."""
    found = [(int(v), what) for v, what in zip(bad, ("loss", "global gradient norm")) if v < NONE_SEEN]
    if found:
        step = min(v for v, _ in found)
        what = " and the ".join(w for v, w in found if v == step)
        verb = "were" if " and " in what else "was"
        raise NonFiniteError(f"the {what} {verb} not finite at optimizer step {step}: stopping (lower "
                             "pretrain.phases[*].learning_rate, raise warmup_steps or check the shards)")
