"""The driver's watch over pre-training attempts: a lost node or failed workers said in one line, each restart
recorded in MLflow.

Ray Train restarts the worker group from the last reported checkpoint when a worker or its node dies (up to
`pretrain.max_failures` times), silently as far as the driver's `fit()` is concerned. The watch is called on every
poll of the progress board (pipeline/framework/console.py `remote_progress(watch=...)`) with the workers' latest
step and fields. It notices:
- a node that was alive when training started and is gone now: at once, the progress line says so ("a worker node
  (10.0.0.7, 2 CPUs) was lost at step 62: restarting the workers") and drops the old attempt's ETA;
- a new attempt's rank 0 reporting where it resumed (`attempt_started`, `resumed_from`, sent after restoring:
  TrainingMetrics.attempt_started): the restart's one line, "a worker node (10.0.0.7, 2 CPUs) was lost at step
  62; restarted from the step-60 checkpoint, attempt 2 of 4" (or "the workers failed at step 31; ..." when no node
  loss explains it).
  Only the new attempt knows the checkpoint: Ray Train resumes from the last one it registered, which can be older
  than the newest folder in storage. Ray Train often restarts before the cluster declares the node dead (its own
  health checks are faster): such a restart is told once the node is declared lost, or after CAUSE_WAIT_S as the
  workers' own failure; the new attempt's own line told meanwhile (where the restart's time went,
  metrics/restart.py) is held back and told after that one, so the console reads cause, then restart;
- a lost node no worker was on: training goes on, and the line says so;
- an elastic run's resize (the new attempt reports another worker count): the line says it, "a worker node
  (10.0.0.7, 2 CPUs) was lost at step 412: going on with 3 workers from the step-400 checkpoint, accumulation
  4 → 5", and when the cluster gives room back, "the cluster grew at step 530: going on with 4 workers from the
  step-500 checkpoint, accumulation 5 → 4" (Ray Train grows a run by a restart; it counts as no failure).
Each restart is an MLflow tag `bertpipe.restart.<attempt>` (the line, with the time) and a point of the series
`train/restarts` (restarts so far) at the step training resumed from.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from bertpipe.jobs.pretrain.metrics.restart import LINE_START
from bertpipe.pipeline.framework.progress import LATER

log = logging.getLogger("bertpipe.pretrain")


def alive_nodes() -> dict[str, str]:
    """{node id: "ip, N CPUs[, M GPUs]"} of the cluster's alive nodes."""
    import ray

    nodes = {}
    for node in ray.nodes():
        if node.get("Alive"):
            res = node.get("Resources", {})
            gpus = f", {res['GPU']:g} GPUs" if res.get("GPU") else ""
            nodes[node["NodeID"]] = f"{node.get('NodeManagerAddress', '?')}, {res.get('CPU', 0):g} CPUs{gpus}"
    return nodes


# Seconds a restart waits for the cluster to name a lost node before it is told as the workers' own failure: Ray
# Train notices a dead worker in a second, the GCS a dead node only after its missed health checks (~15 s).
CAUSE_WAIT_S = 30.0


def _layout(fields: dict[str, Any]) -> tuple[int, int] | None:
    """(workers, accumulation steps) an attempt reported when it started (TrainingMetrics.attempt_started)."""
    if fields.get("workers") is None:
        return None
    return int(fields["workers"]), int(fields.get("accumulation") or 0)


class AttemptWatch:
    def __init__(self, max_failures: int, run: Any, nodes: Callable[[], dict[str, str]] = alive_nodes,
                 clock: Callable[[], float] = time.time, nodes_every_s: float = 1.0):
        self.max_attempts = max_failures + 1
        self.run, self.nodes, self.clock, self.nodes_every_s = run, nodes, clock, nodes_every_s
        self.known = nodes()  # alive when training started: a node that joins later is watched once it is seen
        self.attempt = 1
        self.marker: Any = None  # the attempt_started of the attempt now running
        self.step = 0.0  # the highest step the running attempt reached
        self.lost = ""  # "a worker node (...) was lost", seen before the restart it causes
        self.lost_step = 0.0
        self.restart: tuple[int, float, float] | None = None  # (resumed from, seen at, step reached) not told yet
        self.last_nodes_check = float("-inf")
        self.lines: list[str] = []
        self.layout: tuple[int, int] | None = None  # (workers, accumulation steps) of the attempt now running
        self.resized: tuple[tuple[int, int], tuple[int, int]] | None = None  # (before, now), not told yet
        self.held: list[str] = []  # the new attempt's restart line, told before the restart's cause was known

    def __call__(self, count: float, fields: dict[str, Any]) -> dict[str, Any]:
        """Fields to show over the workers' (a `status` line to print; `doing` and no ETA while the workers
        restart; LATER: the workers' restart line held back until now), {} when nothing happened."""
        shown = self._watch(count, fields)
        told = fields.get("status") or ""
        if self.restart is not None and told.startswith(LINE_START):  # its cause not known yet: told after it
            self.held.append(told)
            return {**shown, "status": None}
        if self.held and self.restart is None:
            shown, self.held = {**shown, LATER: self.held}, []
        return shown

    def held_back(self) -> list[str]:
        """The restart lines still held (training ended before the restart's cause was known), no longer held."""
        held, self.held = self.held, []
        return held

    def _watch(self, count: float, fields: dict[str, Any]) -> dict[str, Any]:
        now = self.clock()
        marker = fields.get("attempt_started")
        if marker is not None and marker != self.marker:
            first = self.marker is None
            self.marker = marker
            was, self.layout = self.layout, _layout(fields)
            if not first:
                self.resized = (was, self.layout) if was and self.layout and was[0] != self.layout[0] else None
                return self._new_attempt(int(fields.get("resumed_from") or 0), now)
        self.step = max(self.step, count)
        lost = self._lost_nodes(now)
        if lost and self.restart is not None:  # the restart came first; the cluster named its cause since
            resumed, _, reached = self.restart
            self.restart = None
            return self._restarted(f"{lost} was lost at step {reached:.0f}", resumed)
        if lost:
            self.lost, self.lost_step = f"{lost} was lost at step {self.step:.0f}", self.step
            if self.attempt >= self.max_attempts:
                told = self._told(f"{self.lost}; no restart left (pretrain.max_failures = {self.max_attempts - 1})")
                self.lost = ""
                return told
            log.info("pretrain: %s; Ray Train restarts the workers from the last checkpoint", self.lost)
        if self.restart is not None and now - self.restart[1] >= CAUSE_WAIT_S:
            resumed, _, reached = self.restart
            self.restart = None
            return self._restarted(f"the workers failed at step {reached:.0f}", resumed)
        if self.lost and count > self.lost_step:  # steps go on: none of the workers was on it
            told = self._told(f"{self.lost}; training goes on (no pre-training worker was on it)")
            self.lost = ""
            return {**told, "doing": ""}
        if self.lost:  # the old attempt's ETA is no estimate now, nor is the count's rate
            return {"doing": f"{self.lost}: restarting the workers", "eta_s": None, "eta_unknown": True}
        return {"eta_unknown": False}

    def _lost_nodes(self, now: float) -> str:
        """The nodes gone since the last look ("a worker node (ip, N CPUs)"), "" when none (read once a second)."""
        if now - self.last_nodes_check < self.nodes_every_s:
            return ""
        self.last_nodes_check = now
        alive = self.nodes()
        lost = [desc for node, desc in self.known.items() if node not in alive]
        self.known = {**{n: d for n, d in self.known.items() if n in alive}, **alive}
        if not lost:
            return ""
        return f"{'a worker node' if len(lost) == 1 else f'{len(lost)} worker nodes'} ({'; '.join(lost)})"

    def _new_attempt(self, resumed_from: int, now: float) -> dict[str, Any]:
        reached, self.step = self.step, float(resumed_from)
        if self.resized and self.resized[1][0] > self.resized[0][0] and not self.lost:  # Ray Train grew the run
            return {**self._told(f"the cluster grew at step {reached:.0f}{self._going_on(resumed_from)}"),
                    "doing": ""}
        self.attempt += 1
        if self.lost:  # the loss was seen first: the restart's line now
            lost, self.lost = self.lost, ""
            return self._restarted(lost, resumed_from)
        self.restart = (resumed_from, now, reached)  # told once the cause is known (or CAUSE_WAIT_S passed)
        return {"doing": "", "eta_unknown": False}

    def _going_on(self, resumed_from: int) -> str:
        """": going on with 3 workers from the step-400 checkpoint, accumulation 4 → 5" of a resize told now."""
        (_, before), (workers, now) = self.resized
        self.resized = None
        where = f"the step-{resumed_from} checkpoint" if resumed_from else "step 0 (no checkpoint yet)"
        return (f": going on with {workers} worker{'s' if workers != 1 else ''} from {where}, accumulation "
                f"{before} → {now}")

    def _restarted(self, cause: str, resumed_from: int) -> dict[str, Any]:
        where = f"the step-{resumed_from} checkpoint" if resumed_from else "step 0 (no checkpoint yet)"
        line = (f"{cause}{self._going_on(resumed_from)}" if self.resized else
                f"{cause}; restarted from {where}, attempt {self.attempt} of {self.max_attempts}")
        try:
            self.run.log_metrics({"train/restarts": self.attempt - 1}, resumed_from)
        except Exception as exc:  # noqa: BLE001 - MLflow unreachable must not stop the watch
            log.info("could not record the restart in MLflow: %s", exc)
        return {**self._told(line), "doing": ""}

    def _told(self, line: str) -> dict[str, Any]:
        self.lines.append(line)
        log.info("pretrain: %s", line)  # the console gets it as the progress line's status
        try:
            self.run.set_tag(f"bertpipe.restart.{len(self.lines) + 1}",
                             f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.clock()))} {line}")
        except Exception as exc:  # noqa: BLE001
            log.info("could not record the restart in MLflow: %s", exc)
        return {"status": line, "eta_s": None, "eta_unknown": False}
