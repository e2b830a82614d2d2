"""Elastic pre-training on Ray Train V2's elastic scaling (pretrain.num_workers = [min, max]).

Ray Train does the scheduling: with ScalingConfig(num_workers=(min, max)) its ElasticScalingPolicy starts the
worker group once `min` workers fit, restarts it on what fits when a worker's node is lost, and grows it by a
restart when more fits (checked every `elastic_resize_monitor_interval_s`). Each restart resumes from the last
checkpoint through the universal-checkpoint path (checkpointing/repartition.py), and the data goes on at its global
position (data/shared_order.py).

What is added to Ray's policy:
- a worker count that cannot split a phase's global batch exactly (global batch = micro-batch × workers ×
  accumulation steps) is never started; the policy takes the largest count of the range below what fits that can.
  The driver says which counts those are, once, when the run starts;
- the cluster's room is read fresh at each decision (Ray Data's autoscaling coordinator, which Ray Train asks,
  refreshes its view of the nodes every 20 s otherwise): a node that joined is used at the next resize check, and
  a restart after a loss does not size the group by a node already gone from the coordinator's view;
- a (re)start or a grow counts only the nodes whose raylet answers: Ray Train restarts the group seconds after a
  worker's node is lost, before the cluster has declared the node dead (its health checks take ~15-30 s), and would
  otherwise size the group by the lost node's room and wait for it until the start times out, or grow toward it;
- nor a node being drained: Ray Train restarts the group at a drain's deadline, while the node is still alive and
  counted, but Ray places nothing new on it;
- a running group is never shrunk by a resize check: a lost node fails its worker, which restarts the group;
- a worker group that does not start within `pretrain.elastic_start_timeout_s` (sized by a node that is gone all
  the same: one whose raylet still answered) is given up sooner than Ray Train's 60 s, and the next try counts again;
- a node that joins is counted for a grow once its warm process is up (warm_start/node_warm_up.py), so the grown
  group does not wait for one cold worker;
- no resize once a worker has reported the run's last step: the workers are then evaluating, exporting and saving
  the last checkpoint, and a group grown then would restart from that checkpoint to do all of it again.
"""
from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import ray
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, NoopDecision, ResizeDecision
from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
    AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
)
from ray.train.v2._internal.util import time_monotonic

from bertpipe.jobs.pretrain.config import PretrainConfig
from bertpipe.jobs.pretrain.failed_start import release_failed_starts
from bertpipe.jobs.pretrain.warm_start.node_warm_up import NodeWarmUp


def whole_batch_world(fits: int, worlds: list[int]) -> int:
    """The largest worker count of `worlds` (those that split every global batch exactly) not above `fits`; 0 when
    none is (Ray Train then waits, as for fewer than min workers)."""
    return max((n for n in worlds if n <= fits), default=0)


RAYLET_PROBE_TIMEOUT_S = 1.0  # a raylet on a live node accepts at once; a lost machine's connect hangs until this


def raylet_answers(address: tuple[str, int], timeout_s: float = RAYLET_PROBE_TIMEOUT_S) -> bool:
    """A TCP connection to the node's raylet opens: refused (the raylet is gone) or timed out (the machine is)
    is False."""
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:
        return False


def draining_nodes() -> set[str]:
    """The ids of the nodes being drained (a spot notice), as Ray Train's preemption watcher reads them; none when
    the cluster cannot say (a restart then counts those nodes, as Ray's own policy does)."""
    try:
        return set(ray._private.state.state.get_draining_nodes() or {})
    except Exception:  # noqa: BLE001 - a look that failed leaves the decision to the raylet probe
        logging.getLogger(__name__).warning("could not read the draining nodes", exc_info=True)
        return set()


def raylet_addresses() -> dict[str, tuple[str, int]]:
    """{node id: (raylet host, port)} of the nodes the cluster holds alive."""
    return {n["NodeID"]: (n["NodeManagerAddress"], int(n["NodeManagerPort"])) for n in ray.nodes()
            if n.get("Alive") and n.get("NodeManagerPort")}


class NodeProbe:
    """Which nodes a new worker group cannot use: those whose raylet does not answer (asked in parallel) and those
    being drained; kept for `fresh_s` (a restart's decision loop asks many times a second)."""

    def __init__(self, addresses: Callable[[], dict[str, tuple[str, int]]] = raylet_addresses,
                 answers: Callable[[tuple[str, int]], bool] = raylet_answers,
                 draining: Callable[[], set[str]] = draining_nodes,
                 clock: Callable[[], float] = time.monotonic, fresh_s: float = 1.0):
        self.addresses, self.answers, self.draining, self.clock, self.fresh_s = (addresses, answers, draining,
                                                                                 clock, fresh_s)
        self._unusable: set[str] = set()
        self._asked_at = float("-inf")

    def unusable(self) -> set[str]:
        now = self.clock()
        if now - self._asked_at >= self.fresh_s:
            where = self.addresses()
            with ThreadPoolExecutor(max_workers=max(1, min(32, len(where)))) as pool:
                answered = dict(zip(where, pool.map(self.answers, where.values())))
            self._unusable = {node for node, ok in answered.items() if not ok} | self.draining()
            self._asked_at = self.clock()
        return self._unusable


def reported_steps(worker_group_status) -> list[int]:
    """The steps of the reports in one poll of the workers (each checkpoint is reported with its step)."""
    return [int(s.training_report.metrics["step"]) for s in worker_group_status.worker_statuses.values()
            if s.training_report is not None and isinstance(s.training_report.metrics.get("step"), (int, float))]


class WholeBatchScalingPolicy(ElasticScalingPolicy):
    """Ray Train's elastic policy, counting only the worker counts that split the global batch exactly and only the
    nodes it can use (NodeProbe), a grow only those whose warm process is up (NodeWarmUp); a running group only
    grows, and not once it has reported `last_step`."""

    def __init__(self, scaling_config, worlds: list[int], last_step: int | None = None,
                 probe: NodeProbe | None = None, warm_up: NodeWarmUp | None = None):
        super().__init__(scaling_config)
        self.worlds = worlds
        self.last_step = last_step
        self.reached = 0  # the highest step reported so far
        self.probe = probe or NodeProbe()
        self.warm_up = warm_up or NodeWarmUp({})
        self._starting = False  # inside the decision for a group not running: a start or a restart

    def after_controller_start(self, train_run_context):
        release_failed_starts()  # in the controller's process: where its worker groups start
        super().after_controller_start(train_run_context)

    def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
        self.reached = max([self.reached, *reported_steps(worker_group_status)])
        if self.last_step is not None and self.reached >= self.last_step:
            return NoopDecision()  # training is over (the module's docstring)
        self.warm_up.started_on(w.metadata.node_id for w in worker_group_state.workers)
        if self.warm_up.poll():
            self._latest_monitor_time = float("-inf")  # a node just warmed: look now, not a whole interval later
        decision = super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
        if isinstance(decision, ResizeDecision) and decision.num_workers < worker_group_state.num_workers:
            return NoopDecision()  # a lost node fails its worker and restarts the group: a look only grows it
        return decision

    def make_decision_for_non_running_worker_group(self):
        self._starting = True
        try:
            return super().make_decision_for_non_running_worker_group()
        finally:
            self._starting = False

    def _count_possible_workers(self, reserved_resources) -> int:
        if reserved_resources:
            # A node that does not answer or is being drained holds no new worker: a (re)start would wait for it,
            # a grow would restart the group toward it. A running group is never shrunk here (its lost node fails
            # a worker, which restarts it through a start), so a moment's silence costs nothing, and a drained
            # node's workers train on to the drain's checkpoint.
            unusable = self.probe.unusable()
            reserved_resources = {node: res for node, res in reserved_resources.items() if node not in unusable}
            if not self._starting:
                cold = self.warm_up.not_ready(reserved_resources)
                reserved_resources = {node: res for node, res in reserved_resources.items() if node not in cold}
        return whole_batch_world(super()._count_possible_workers(reserved_resources), self.worlds)

    def _get_reserved_resources(self):
        """Ray's, but recomputed against the cluster's nodes now (at most once a second, as Ray's)."""
        now = time_monotonic()
        if now - self._latest_reserved_resources_query_time < self.GET_RESERVED_RESOURCES_INTERVAL_S:
            return self._latest_reserved_resources
        try:
            self._latest_reserved_resources = ray.get(
                self._autoscaling_coordinator.get_reserved_resources.remote(self._requester_id, recompute=True),
                timeout=AUTOSCALING_REQUESTS_GET_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - as Ray's: no resize on this look
            logging.getLogger(__name__).warning("could not read the reserved resources", exc_info=True)
            self._latest_reserved_resources = None
        self._latest_reserved_resources_query_time = time_monotonic()
        return self._latest_reserved_resources


class ElasticTorchTrainer(TorchTrainer):
    """A TorchTrainer whose elastic scaling policy is WholeBatchScalingPolicy (fit() builds Ray's own otherwise)."""

    def __init__(self, *args, worlds: list[int], last_step: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.worlds, self.last_step = worlds, last_step

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        controller_init_kwargs["scaling_policy"] = WholeBatchScalingPolicy(
            self.scaling_config, self.worlds, self.last_step, warm_up=NodeWarmUp(self.run_config.worker_runtime_env))
        return super()._initialize_and_run_controller(**controller_init_kwargs)


def worlds_line(cfg: PretrainConfig) -> str:
    """The start's one line on an elastic range: which worker counts hold the global batch exactly, and what a
    cluster holding another count trains on."""
    worlds = cfg.whole_batch_worlds()
    odd = [n for n in range(cfg.min_workers, cfg.max_workers + 1) if n not in worlds]
    accumulation = ", ".join(f"{n} worker{'s' if n != 1 else ''} × accumulation {accumulation_at(cfg, n)}"
                             for n in worlds)
    line = (f"pretrain: elastic, {cfg.min_workers} to {cfg.max_workers} workers; the global batch stays "
            f"({accumulation})")
    if odd:
        line += (f"; {', '.join(map(str, odd))} worker{'s' if odd != [1] else ''} would not split it exactly: such "
                 f"a cluster trains on the largest count below that does")
    return line


def accumulation_at(cfg: PretrainConfig, world: int) -> str:
    """Gradient accumulation steps of each phase at `world` workers ("4", or "4/2" over two phases)."""
    return "/".join(str(ph.accumulation(world)) for ph in cfg.phases)
