"""The driver's watch over pre-training attempts: a lost node or failed workers said in one line, each restart
recorded in MLflow.

Ray Train restarts the worker group from the last reported checkpoint when a worker or its node dies (up to
`pretrain.max_failures` times), silently as far as the driver's `fit()` is concerned. The watch is called on every
poll of the progress board (pipeline/progress.py `remote_progress(watch=...)`) with the workers' latest step and
fields. It notices:
- a node that was alive when training started and is gone now: "a worker node (10.0.0.7, 2 CPUs) was lost at step
  62; restarting from the step-60 checkpoint, attempt 2 of 4", at once, and the stale ETA is dropped;
- a new attempt's rank 0 reporting where it resumed (`attempt_started`, `resumed_from`, sent by loop.py after
  restoring): a restart no node loss explained gets its line then ("the workers failed at step 31; ...").
Each restart is an MLflow tag `bertpipe.restart.<attempt>` (the line, with the time) and the series
`train/restarts` (attempts so far, at the step where training stood).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

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


class AttemptWatch:
    def __init__(self, max_failures: int, checkpoint_step: Callable[[], int | None], run: Any,
                 nodes: Callable[[], dict[str, str]] = alive_nodes, clock: Callable[[], float] = time.time,
                 nodes_every_s: float = 1.0):
        self.max_attempts = max_failures + 1
        self.checkpoint_step, self.run, self.nodes, self.clock = checkpoint_step, run, nodes, clock
        self.nodes_every_s = nodes_every_s
        self.known = nodes()  # alive when training started: a node that joins later is not watched until it is
        self.attempt = 1
        self.marker: Any = None  # the attempt_started of the attempt now running
        self.step = 0.0  # the highest step the running attempt reached
        self.told_loss = False  # this restart was told at the loss: its attempt's start adds no second line
        self.last_nodes_check = float("-inf")
        self.lines: list[str] = []

    def __call__(self, count: float, fields: dict[str, Any]) -> dict[str, Any]:
        """Fields to show with the workers' (a `status` line to print, `eta_s` dropped), {} when nothing happened."""
        marker = fields.get("attempt_started")
        if marker is not None and marker != self.marker:
            first = self.marker is None
            self.marker = marker
            if not first:
                return self._new_attempt(int(fields.get("resumed_from") or 0))
        self.step = max(self.step, count)
        now = self.clock()
        if now - self.last_nodes_check < self.nodes_every_s:
            return {}
        self.last_nodes_check = now
        alive = self.nodes()
        lost = [desc for node, desc in self.known.items() if node not in alive]
        self.known = {**{n: d for n, d in self.known.items() if n in alive}, **alive}
        if not lost or self.told_loss:
            return {}
        self.attempt += 1
        self.told_loss = True
        what = "a worker node" if len(lost) == 1 else f"{len(lost)} worker nodes"
        lost_line = f"{what} ({'; '.join(lost)}) was lost at step {self.step:.0f}"
        if self.attempt > self.max_attempts:
            return self._restart(f"{lost_line}; no restart left (pretrain.max_failures = {self.max_attempts - 1})",
                                 counted=False)
        resumed = self.checkpoint_step()
        where = f"the step-{resumed} checkpoint" if resumed else "step 0 (no checkpoint yet)"
        return self._restart(f"{lost_line}; restarting from {where}")

    def _new_attempt(self, resumed_from: int) -> dict[str, Any]:
        if self.told_loss:  # the loss was told; the new attempt is the restart it announced
            self.told_loss = False
            self.step = resumed_from
            return {"doing": ""}
        self.attempt += 1
        line = (f"the workers failed at step {self.step:.0f}; restarted from "
                + (f"the step-{resumed_from} checkpoint" if resumed_from else "step 0 (no checkpoint yet)"))
        self.step = resumed_from
        return {**self._restart(line), "doing": ""}

    def _restart(self, cause: str, counted: bool = True) -> dict[str, Any]:
        line = f"{cause}, attempt {self.attempt} of {self.max_attempts}" if counted else cause
        self.lines.append(line)
        log.warning("pretrain: %s", line)
        try:
            self.run.set_tag(f"bertpipe.restart.{self.attempt}",
                             f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.clock()))} {line}")
            self.run.log_metrics({"train/restarts": self.attempt - 1}, int(self.step))
        except Exception as exc:  # noqa: BLE001 - MLflow unreachable must not stop the watch
            log.info("could not record the restart in MLflow: %s", exc)
        return {"status": line, "eta_s": None, "doing": "restarting the workers"}
