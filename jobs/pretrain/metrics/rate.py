"""The driver's progress figures of pre-training: the loss and the rate in sequences a second.

The rate is the driver's own, from the optimizer steps the workers report with the time each ended: sequences
trained by every worker (each step trains one global batch, whatever the worker count) over the last WINDOW_S of
steps. A worker's logging window cannot give it: it is one window old when the progress line shows it, and the
last one of a run is whatever window closed last. Samples start again when the step goes back (a restart resumes
from an earlier checkpoint), so a window never spans two attempts; a resize changes nothing (the global batch does
not change).
"""
from __future__ import annotations

from collections import deque
from typing import Any

from bertpipe.jobs.pretrain.config import PretrainConfig

WINDOW_S = 30.0


def sequences_at(cfg: PretrainConfig, step: int) -> int:
    """Sequences trained by all workers together after optimizer step `step`."""
    done, start = 0, 0
    for phase, steps in zip(cfg.phases, cfg.phase_steps()):
        done += min(max(step - start, 0), steps) * phase.global_batch_size
        start += steps
    return done


class ProgressFigures:
    """describe(fields) of the progress line: "loss 4.417 · 262.3 seq/s". Fields read: `loss`, `step_at` ([step,
    the worker's time.time() when it ended]: TrainingMetrics.optimizer_step)."""

    def __init__(self, cfg: PretrainConfig, window_s: float = WINDOW_S):
        self.cfg, self.window_s = cfg, window_s
        self.samples: deque[tuple[float, int]] = deque()  # (time, step), oldest first

    def __call__(self, fields: dict[str, Any]) -> str:
        parts = [f"loss {fields['loss']:.3f}" if fields.get("loss") is not None else ""]
        rate = self.rate(fields.get("step_at"))
        parts.append(f"{rate:.1f} seq/s" if rate else "")
        return " · ".join(p for p in parts if p)

    def rate(self, step_at: Any) -> float | None:
        if not step_at:
            return None
        step, at = int(step_at[0]), float(step_at[1])
        if self.samples and step < self.samples[-1][1]:  # a restart: the new attempt's steps start a new window
            self.samples.clear()
        if not self.samples or step != self.samples[-1][1]:
            self.samples.append((at, step))
        while len(self.samples) > 2 and at - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        (t0, s0), (t1, s1) = self.samples[0], self.samples[-1]
        if t1 <= t0:
            return None
        return (sequences_at(self.cfg, s1) - sequences_at(self.cfg, s0)) / (t1 - t0)
