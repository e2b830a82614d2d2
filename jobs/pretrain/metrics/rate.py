"""The driver's progress figures of pre-training: the loss and the rate in sequences a second.

The rate is the driver's own, from the optimizer steps the workers report with the time each ended: sequences
trained by every worker (each step trains one global batch, whatever the worker count) over the last WINDOW_S of
steps. A worker's logging window cannot give it: it is one window old when the progress line shows it, and the
last one of a run is whatever window closed last. Samples start again with each attempt (a restart, a resize: its
rank 0 reports when it started), so a window never spans the time the workers were restarting; a resize changes
nothing else (the global batch does not change).
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
    rank 0's time.time() when it ended]: TrainingMetrics.optimizer_step), `attempt_started` (rank 0's time.time()
    when the attempt started: TrainingMetrics.attempt_started)."""

    def __init__(self, cfg: PretrainConfig, window_s: float = WINDOW_S):
        self.cfg, self.window_s = cfg, window_s
        self.samples: deque[tuple[float, int]] = deque()  # (time, step), oldest first
        self.attempt = 0.0  # when the attempt the samples are of started

    def __call__(self, fields: dict[str, Any]) -> str:
        parts = [f"loss {fields['loss']:.3f}" if fields.get("loss") is not None else ""]
        rate = self.rate(fields.get("step_at"), float(fields.get("attempt_started") or 0.0))
        parts.append(f"{rate:.1f} seq/s" if rate else "")
        return " · ".join(p for p in parts if p)

    def rate(self, step_at: Any, attempt_started: float = 0.0) -> float | None:
        if attempt_started != self.attempt:  # a new attempt: its steps start a new window
            self.attempt = attempt_started
            self.samples.clear()
        if not step_at or float(step_at[1]) < attempt_started:  # (the last attempt's last step)
            return None
        step, at = int(step_at[0]), float(step_at[1])
        if not self.samples or step != self.samples[-1][1]:
            self.samples.append((at, step))
        while len(self.samples) > 2 and at - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        (t0, s0), (t1, s1) = self.samples[0], self.samples[-1]
        if t1 <= t0:
            return None
        return (sequences_at(self.cfg, s1) - sequences_at(self.cfg, s0)) / (t1 - t0)
