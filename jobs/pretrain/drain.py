"""A node of the run announced its end: Ray's drain API with a deadline, which cloud autoscalers call on a spot
preemption notice (`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`).

Ray Train's preemption watcher sees the drain and tells every worker (`ray.train.get_preemption_info()`, a barrier
of all ranks: the loop asks every `pretrain.drain_check_every_steps` steps); its controller keeps the worker group
running until the deadline, then restarts it on what is left (elastic: fewer workers) from the last checkpoint.
The workers train on while the deadline is far, checkpoint once it comes within what a checkpoint takes (the last
one measured, twice over) plus a check interval and a margin, and then hold until Ray Train restarts them: the
restart resumes from that checkpoint, so no step is trained twice. Without a deadline they checkpoint at once.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("bertpipe.pretrain")

MARGIN_S = 5.0  # kept free before the deadline: the report to Ray Train and the clocks' skew
GUESS_CHECKPOINT_S = 10.0  # what a checkpoint is taken to cost before one was measured
# Seconds past the deadline the workers hold before going on training: the node was not taken after all.
HOLD_PAST_DEADLINE_S = 60.0
NO_DEADLINE_S = 120.0  # Ray Train's own wait for a drain without a deadline (DEFAULT_PREEMPTION_DEADLINE_S)


def checkpoint_due(deadline_ms: int | None, now_s: float, checkpoint_s: float | None, check_every_s: float) -> bool:
    """Whether the drain's checkpoint must be taken now: no deadline given, or the next check could come too late
    for a checkpoint (`checkpoint_s`: the last one measured, None = none yet) to end before the deadline."""
    if deadline_ms is None:
        return True
    left = deadline_ms / 1000.0 - now_s
    return left <= 2 * (checkpoint_s or GUESS_CHECKPOINT_S) + check_every_s + MARGIN_S


@dataclass
class DrainNotice:
    """What rank 0 decided about a drain at a check (every rank acts on it alike)."""

    due: bool
    line: str = ""
    hold_until_s: float = 0.0


def notice(info, step: int, now_s: float, checkpoint_s: float | None, check_every_s: float) -> DrainNotice:
    """Rank 0's decision on `info` (a ray.train.PreemptionInfo) at optimizer step `step`."""
    due = checkpoint_due(info.deadline_ms, now_s, checkpoint_s, check_every_s)
    if not due:
        return DrainNotice(False)
    nodes = ", ".join(n[:8] for n in info.preempted_node_ids)
    ranks = ", ".join(map(str, info.preempted_ranks))
    deadline = (f"deadline in {info.deadline_ms / 1000.0 - now_s:.0f} s" if info.deadline_ms is not None
                else "no deadline given")
    line = (f"node {nodes} (rank{'s' if len(info.preempted_ranks) != 1 else ''} {ranks}) is being drained "
            f"({deadline}): checkpoint at step {step}, then the workers wait for Ray Train to go on without it")
    until = (info.deadline_ms / 1000.0 if info.deadline_ms is not None else now_s + NO_DEADLINE_S)
    return DrainNotice(True, line, until + HOLD_PAST_DEADLINE_S)


def hold_until_restart(until_s: float, clock: Callable[[], float] = time.time,
                       sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait for Ray Train to restart the worker group (it ends this process), at most until `until_s`."""
    while clock() < until_s:
        sleep(min(1.0, max(until_s - clock(), 0.0)))
    log.info("the drained node was not taken by the deadline: training goes on")
