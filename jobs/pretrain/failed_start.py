"""A worker group whose start fails after its workers exist is shut down, in Ray Train's controller.

Ray Train (seen in 2.60) builds a worker group's state (placement group, worker actors, sync actor) before its
after-start callbacks run; when one of those fails (its torch backend's set-up meets a worker whose node was just
lost), `WorkerGroup._start` keeps the state, since the group "has started", while the controller never receives
the group to shut it down. Its live workers then hold their CPUs for good, and every later start of the run waits
for resources that never come back (the chaos bench: a node killed while the run grew onto a new one, then "worker
group startup timed out" every 30 s). release_failed_starts() shuts such a group down before the error goes on.
A worker lost while the group launches its training function (after those callbacks) is a failed start too: Ray
Train raised it as it came, which its failure policy counts as a controller error and does not retry (the chaos
bench: the run ended at the second kill); it now goes on as the WorkerGroupStartupFailedError Ray raises for a
worker lost a moment earlier, which is retried.

Both kinds of run install it in their controller: an elastic run through its policy (elastic.py), a run of a fixed
worker count through FixedTorchTrainer here (where a leaked group waits as long: its retry needs every worker).
"""
from __future__ import annotations

import logging

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

log = logging.getLogger(__name__)


def release_failed_starts() -> None:
    """Wraps Ray Train's WorkerGroup._start, once per process (the controller's, where its policy calls it)."""
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    started = WorkerGroup._start
    if getattr(started, "releases_failed_starts", False):
        return

    def start_or_release(group: WorkerGroup) -> None:
        try:
            started(group)
        except Exception as error:
            if not group.has_started():
                raise
            log.info("pretrain: a worker group failed after its workers started: shutting them down")
            try:
                group.abort()  # its workers, sync actor and placement group; no hook that asks the workers
            except Exception:  # noqa: BLE001 - the start's own error is the one to raise
                log.warning("could not shut down the failed worker group", exc_info=True)
            if isinstance(error, RayActorError):
                raise WorkerGroupStartupFailedError("A worker was lost while the worker group started.") from error
            raise

    start_or_release.releases_failed_starts = True
    WorkerGroup._start = start_or_release


class ReleasingFixedScalingPolicy(FixedScalingPolicy):
    """Ray Train's policy for a fixed worker count, releasing failed starts in the controller it runs in."""

    def after_controller_start(self, train_run_context):
        release_failed_starts()
        super().after_controller_start(train_run_context)


class FixedTorchTrainer(TorchTrainer):
    """A TorchTrainer of a fixed worker count whose controller releases failed starts (fit() builds Ray's own
    policy otherwise)."""

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        controller_init_kwargs["scaling_policy"] = ReleasingFixedScalingPolicy(self.scaling_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)
