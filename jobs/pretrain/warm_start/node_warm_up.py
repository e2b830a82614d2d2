"""A joining node's warm process, started before an elastic run grows onto the node (used by elastic.py's policy).

A grow restarts every worker; the new node's worker would otherwise be the group's one cold start, waiting for its
node's warm process to import everything while the others wait for it. A task with the training workers' runtime
env (so the same launcher, environment and warm process), using no CPU, starts that process; the policy counts the
node once the task has run, or after WARM_UP_TIMEOUT_S in any case. Runs in Ray Train's controller.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

# A child of Ray Train's logger: its lines land in the controller's log (logs/train/ray-train-sys-controller-*.log).
log = logging.getLogger("ray.train.bertpipe_warm_up")

WARM_UP_TIMEOUT_S = 120.0  # a node whose warm-up has not finished by then is counted all the same


@ray.remote(num_cpus=0, max_retries=0)
def warmed() -> bool:
    """Runs in a worker the node's warm process forked (or started it for): by then that process is ready."""
    return True


def training_worker_runtime_env(custom: dict[str, Any]) -> dict[str, Any]:
    """The runtime env Ray Train gives the training workers (its propagated variables added), as computed in this
    same controller process."""
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    return WorkerGroup._get_worker_runtime_env(custom_runtime_env=custom)


def start_warm_up(node: str, runtime_env: dict[str, Any]) -> ray.ObjectRef:
    return warmed.options(runtime_env=runtime_env,
                          scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()


def finished(ref: ray.ObjectRef) -> bool:
    done, _ = ray.wait([ref], timeout=0)
    if done:
        try:
            ray.get(ref)
        except Exception:  # noqa: BLE001 - the node is counted all the same; its workers start cold at worst
            log.warning("a node's warm-up failed", exc_info=True)
    return bool(done)


class NodeWarmUp:
    """Which nodes a grow may count: those whose warm process is up (a warm-up task has run there, or a worker group
    started there); the warm-up of the others is started when they are first seen. Off (every node counted) when
    the workers start as fresh processes (`custom_runtime_env` without the launcher)."""

    def __init__(self, custom_runtime_env: dict[str, Any], timeout_s: float = WARM_UP_TIMEOUT_S,
                 start: Callable[[str, dict[str, Any]], Any] = start_warm_up,
                 done: Callable[[Any], bool] = finished, clock: Callable[[], float] = time.monotonic):
        self.custom, self.timeout_s, self.start, self.done, self.clock = (custom_runtime_env, timeout_s, start,
                                                                          done, clock)
        self.enabled = "py_executable" in custom_runtime_env
        self.ready: set[str] = set()
        self.pending: dict[str, tuple[Any, float]] = {}  # node: (its warm-up, when it began)
        self._runtime_env: dict[str, Any] | None = None

    def started_on(self, nodes: Iterable[str]) -> None:
        """A worker group runs on `nodes`: their workers started the warm processes there."""
        self.ready.update(nodes)

    def not_ready(self, nodes: Iterable[str]) -> set[str]:
        """Of `nodes`, those to leave out of a grow for now."""
        if not self.enabled:
            return set()
        nodes = set(nodes)
        for node in nodes - self.ready - set(self.pending):
            try:
                self.pending[node] = (self.start(node, self.runtime_env()), self.clock())
                log.info("pretrain: starting the warm process on node %s before growing onto it", node)
            except Exception:  # noqa: BLE001 - a warm-up that cannot start leaves the node to a cold start
                log.warning("could not start a warm-up on node %s", node, exc_info=True)
                self.ready.add(node)
        self.poll()
        return nodes - self.ready

    def poll(self) -> bool:
        """Moves the finished (or timed-out) warm-ups' nodes to the ready ones; whether any moved."""
        moved = False
        for node, (warm_up, since) in list(self.pending.items()):
            done = self.done(warm_up)
            if done or self.clock() - since > self.timeout_s:
                del self.pending[node]
                self.ready.add(node)
                moved = True
                log.info("node %s: warm-up %s", node, "done" if done else "timed out")
        return moved

    def runtime_env(self) -> dict[str, Any]:
        if self._runtime_env is None:
            self._runtime_env = training_worker_runtime_env(self.custom)
        return self._runtime_env
