"""Waiting for a cluster to grow: a stage that needs more CPUs/GPUs than the Ray cluster has now.

On KubeRay and the cluster launcher the GPU worker group starts at zero nodes and the autoscaler adds them when
something asks; a check that reads the cluster's size once refuses every such run. So a stage states what it needs
(`Need`), asks the autoscaler for it (`ray.autoscaler.sdk.request_resources`, a no-op where none runs), and waits
up to `ray.wait_for_resources_s`, saying every SAY_EVERY_S seconds what it waits for and what the cluster has. With
no wait configured, or when the wait runs out, the stage fails with what is missing and how to fix it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

SAY_EVERY_S = 10.0
CAPACITY_POLL_S = 1.0


@dataclass(frozen=True)
class Need:
    """What a stage's Ray Train workers take, and the CPUs that must stay free beside them (data loading)."""

    what: str  # "pretrain"
    workers: int
    cpus_per_worker: float
    gpus_per_worker: float = 0.0
    spare_cpus: float = 1.0

    def bundles(self) -> list[dict[str, float]]:
        bundle = {"CPU": self.cpus_per_worker, **({"GPU": self.gpus_per_worker} if self.gpus_per_worker else {})}
        return [dict(bundle) for _ in range(self.workers)] + ([{"CPU": self.spare_cpus}] if self.spare_cpus else [])

    def shortfall(self, cluster: dict[str, float]) -> str:
        """What is missing from a cluster of these total resources, as a clause ("" when it fits)."""
        need_cpu = self.workers * self.cpus_per_worker
        have_cpu = float(cluster.get("CPU", 0))
        if have_cpu - need_cpu < self.spare_cpus:
            return (f"{self.what} needs num_workers × cpus_per_worker = {self.workers} × {self.cpus_per_worker:g} = "
                    f"{need_cpu:g} CPUs plus at least {self.spare_cpus:g} for data loading, but the Ray cluster has "
                    f"{have_cpu:g} CPUs")
        need_gpu = self.workers * self.gpus_per_worker
        have_gpu = float(cluster.get("GPU", 0))
        if have_gpu < need_gpu:
            return (f"{self.what} with use_gpu and {self.workers} workers needs {need_gpu:g} GPUs, the Ray cluster "
                    f"has {have_gpu:g}")
        return ""

    def waiting_line(self, cluster: dict[str, float], left_s: float) -> str:
        gpus = self.workers * self.gpus_per_worker
        cpus = self.workers * self.cpus_per_worker + self.spare_cpus
        wants = f"{gpus:g} GPUs and {cpus:g} CPUs" if gpus else f"{cpus:g} CPUs"
        has = (f"{float(cluster.get('GPU', 0)):g} GPUs and {float(cluster.get('CPU', 0)):g} CPUs" if gpus
               else f"{float(cluster.get('CPU', 0)):g} CPUs")
        return (f"{self.what}: waiting for {wants}: the cluster has {has}; waiting for nodes to join "
                f"({left_s:.0f} s left of ray.wait_for_resources_s)")


FIX = ("lower pretrain.num_workers / cpus_per_worker, add nodes, or let the cluster grow: "
       "--set ray.wait_for_resources_s=<seconds>")


def wait_for(need: Need, wait_s: float, resources: Callable[[], dict[str, float]],
             say: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep, ask: Callable[[Need], None] | None = None) -> float:
    """Return once `resources()` (the cluster's totals) fits `need`, with the seconds waited; ValueError with the
    shortfall when it does not and `wait_s` is 0 or has run out. `ask(need)` tells the autoscaler, once."""
    started = clock()
    missing = need.shortfall(resources())
    if not missing:
        return 0.0
    if wait_s <= 0:
        raise ValueError(f"{missing}; {FIX}")
    if ask is not None:
        ask(need)
    next_say = started
    while True:
        now = clock()
        cluster = resources()
        missing = need.shortfall(cluster)
        if not missing:
            log.info("%s: the cluster has what it needs after %.0f s", need.what, now - started)
            return now - started
        if now - started >= wait_s:
            raise ValueError(f"{missing} after waiting {wait_s:g} s for nodes to join (ray.wait_for_resources_s); "
                             f"{FIX.replace('=<seconds>', '=<more seconds>')}")
        if now >= next_say:
            say(need.waiting_line(cluster, wait_s - (now - started)))
            next_say = now + SAY_EVERY_S
        sleep(CAPACITY_POLL_S)


def ask_autoscaler(need: Need) -> None:
    """Tell an autoscaler (KubeRay's, the launcher's) what the stage waits for, so it adds nodes before the Ray Train
    workers ask for them; without one the request is only recorded."""
    try:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=need.bundles())
    except Exception as exc:  # noqa: BLE001 - a request the autoscaler cannot take must not stop the wait
        log.info("could not ask the autoscaler for %s: %s", need.bundles(), exc)


def release_request() -> None:
    """Drop the standing request once the stage has its workers (they hold the resources themselves)."""
    try:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[])
    except Exception as exc:  # noqa: BLE001
        log.info("could not clear the autoscaler request: %s", exc)
