"""Where a restarted attempt's seconds went: from Ray Train beginning to start its workers (attempt_clock.py) to its
first new optimizer step, in parts.

- worker start: the controller's share, from starting the group to the train function's entry on this worker
  (placement group, actors, imports, the process group; the controller's clock against the worker's);
- DeepSpeed set-up: the model and engine (engine/build.build_engine);
- checkpoint load: finding the checkpoint and loading it (re-partitioned or not);
- compile: the first step of a compiled model, with the load of the compile cache the checkpoint carries
  (checkpointing/compile_cache.py); 0 without compile;
- first batch: the data streams opened, the held-out rows read and the first micro-batch ready.
What is left of the total is the first step's own compute (its micro-batches after the first) and the smaller
things between (the evaluation's timing on a CPU, the barriers).

Rank 0 logs, at the attempt's first new step, one MLflow point per part and the total (RESTART_METRICS) and one
console line (`line`); a run's first attempt is no restart: its figures go to the worker's log only.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

from bertpipe.jobs.services.tracking import RESTART

if TYPE_CHECKING:
    from bertpipe.jobs.pretrain.attempt_clock import AttemptStamp

PARTS = ("worker_start", "engine_setup", "checkpoint_load", "compile", "first_batch")
LABELS = {"worker_start": "worker start", "engine_setup": "DeepSpeed set-up", "checkpoint_load": "checkpoint load",
          "compile": "compile", "first_batch": "first batch"}
LINE_START = "restart (attempt "  # the console line's: the driver's watch knows it by this (attempts.py)
# The MLflow names, seconds each: the parts, then the total (benchmarks/bench_chaos.py reads them).
RESTART_METRICS = {**{p: f"{RESTART}{p}_s" for p in PARTS}, "total": f"{RESTART}total_s"}


class RestartClock:
    """One attempt's parts, marked by the worker as it starts; `first_step()` closes them once."""

    def __init__(self, stamp: AttemptStamp | None, entered_at: float, now: Callable[[], float] = time.perf_counter):
        """`stamp`: the attempt (None: not started by Ray Train's controller: nothing is measured); `entered_at`:
        time.time() at the train function's entry."""
        self.stamp, self.now = stamp, now
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.parts["worker_start"] = max(entered_at - stamp.started_at, 0.0) if stamp else 0.0
        self.entered = now()
        self.pending = stamp is not None  # until the attempt's first optimizer step
        self.batch_seen = False
        self.compile_note = ""
        self.worker_note = ""

    @property
    def is_restart(self) -> bool:
        return self.stamp is not None and self.stamp.attempt > 1

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        started = self.now()
        try:
            yield
        finally:
            self.add(name, self.now() - started)

    def add(self, name: str, seconds: float) -> None:
        if self.pending:
            self.parts[name] += seconds

    def move(self, seconds: float, source: str, target: str) -> None:
        """`seconds` timed as `source` belong to `target` (the compile cache read with the checkpoint)."""
        if self.pending:
            self.parts[source] -= seconds
            self.parts[target] += seconds

    def batch_ready(self, seconds: float) -> None:
        """A micro-batch took `seconds` to get ready: the attempt's first one ends the first-batch part."""
        if not self.batch_seen:
            self.batch_seen = True
            self.add("first_batch", seconds)

    def first_step(self) -> dict[str, float] | None:
        """{part: seconds, "total": seconds} at the attempt's first optimizer step; None after it (or unmeasured)."""
        if not self.pending:
            return None
        self.pending = False
        return {**self.parts, "total": self.parts["worker_start"] + self.now() - self.entered}


def metric_values(breakdown: dict[str, float]) -> dict[str, float]:
    return {RESTART_METRICS[k]: max(v, 0.0) for k, v in breakdown.items()}


def line(breakdown: dict[str, float], step: int, attempt: int, compile_note: str = "", worker_note: str = "") -> str:
    """"restart (attempt 2) reached step 23 in 12.3 s: worker start 3.1 s (forked warm), ..., rest 4.8 s"."""
    rest = breakdown["total"] - sum(breakdown[p] for p in PARTS)
    notes = {"compile": compile_note, "worker_start": worker_note}
    shown = [f"{LABELS[p]} {breakdown[p]:.1f} s" + (f" ({notes[p]})" if notes.get(p) else "")
             for p in PARTS if p != "compile" or breakdown[p] or compile_note]
    return (f"{LINE_START}{attempt}) reached step {step} in {breakdown['total']:.1f} s: {', '.join(shown)}, "
            f"rest {max(rest, 0.0):.1f} s")
