"""When Ray Train started each attempt of a run, as its controller saw it, handed to the attempt's workers.

A restart's first seconds pass in the controller (a new placement group, the worker actors, their process group)
before any worker code runs; the workers can time everything after their train function starts, but not that. The
controller calls AttemptClock (a Ray Train worker-group callback) before it starts a worker group and once the
group's actors are up, before their train function runs: it counts the attempts and tells every worker of the new
group (Worker.execute) its attempt number and when the controller began starting it. A start that timed out and
was tried again (an elastic group sized by a node not declared dead yet) counts from its first try: the restart
waited for both. The train function reads them with `attempt_stamp()` (metrics/restart.py times the rest).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ray.train.v2._internal.execution.callback import WorkerGroupCallback


@dataclass(frozen=True)
class AttemptStamp:
    attempt: int  # 1: the run's (this fit()'s) first worker group; higher: a restart or a resize
    started_at: float  # the controller's time.time() when it began starting the group


_stamp: AttemptStamp | None = None  # this worker process's: its attempt's (each attempt has fresh actors)


def _receive(attempt: int, started_at: float) -> None:
    global _stamp
    _stamp = AttemptStamp(attempt, started_at)


def attempt_stamp() -> AttemptStamp | None:
    """This worker's attempt (None outside a Ray Train worker group this clock stamped)."""
    return _stamp


class AttemptClock(WorkerGroupCallback):
    """Given to Ray Train's RunConfig(callbacks=...); runs in the controller, one object for the run's life."""

    def __init__(self) -> None:
        self.attempts = 0
        self.starting_since: float | None = None  # the first try of the group being started

    def before_worker_group_start(self, worker_group_context) -> None:
        if self.starting_since is None:
            self.starting_since = time.time()

    def after_worker_group_start(self, worker_group) -> None:
        since = self.starting_since or time.time()
        worker_group.execute(_receive, self.attempts + 1, since)
        self.attempts, self.starting_since = self.attempts + 1, None
