"""Waiting for a cluster to grow (jobs/services/capacity.py), on a fake clock: the wait says every 10 s what it waits
for and what the cluster has, returns as soon as nodes joined, and fails with the shortfall when the wait runs out or
none is configured. The real cluster that grows is in tests/test_multinode.py."""
from __future__ import annotations

import pytest

from bertpipe.jobs.services.capacity import Need, wait_for
from bertpipe.jobs.pretrain.config import PretrainConfig
from bertpipe.jobs.pretrain.stage import resource_need


class FakeCluster:
    """A cluster whose totals change at given seconds of a fake clock; sleeping moves the clock."""

    def __init__(self, timeline: list[tuple[float, dict[str, float]]]):
        self.now, self.timeline, self.lines, self.asked = 0.0, timeline, [], []

    def resources(self) -> dict[str, float]:
        return [have for at, have in self.timeline if at <= self.now][-1]

    def wait(self, need: Need, wait_s: float) -> float:
        return wait_for(need, wait_s, self.resources, self.lines.append, clock=lambda: self.now,
                        sleep=self.sleep, ask=self.asked.append)

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_waits_for_a_gpu_node_the_autoscaler_adds_saying_what_it_waits_for_every_10_s():
    need = resource_need(PretrainConfig(num_workers=2, cpus_per_worker=2, use_gpu=True))
    cluster = FakeCluster([(0, {"CPU": 1}), (25, {"CPU": 17, "GPU": 2})])
    assert cluster.wait(need, 900) == 25
    assert len(cluster.lines) == 3  # at 0, 10 and 20 s
    assert cluster.lines[0] == ("pretrain: waiting for 2 GPUs and 5 CPUs: the cluster has 0 GPUs and 1 CPUs; "
                                "waiting for nodes to join (900 s left of ray.wait_for_resources_s)")
    assert "(880 s left" in cluster.lines[2]
    assert cluster.asked == [need] and need.bundles() == [{"CPU": 2, "GPU": 1}] * 2 + [{"CPU": 1}]


def test_a_cluster_that_already_fits_never_waits_nor_asks():
    cluster = FakeCluster([(0, {"CPU": 8})])
    assert cluster.wait(resource_need(PretrainConfig(num_workers=2)), 900) == 0
    assert cluster.lines == [] and cluster.asked == []


def test_the_wait_runs_out_with_the_shortfall_and_the_fix():
    cluster = FakeCluster([(0, {"CPU": 1})])
    with pytest.raises(ValueError) as err:
        cluster.wait(resource_need(PretrainConfig(num_workers=2, cpus_per_worker=1)), 30)
    assert cluster.now == 30
    assert str(err.value).startswith("pretrain needs num_workers × cpus_per_worker = 2 × 1 = 2 CPUs plus at least 1 "
                                     "for data loading, but the Ray cluster has 1 CPUs after waiting 30 s")
    assert "ray.wait_for_resources_s=<more seconds>" in str(err.value)


def test_without_a_wait_a_short_cluster_is_refused_at_once():
    cluster = FakeCluster([(0, {"CPU": 4}), (5, {"CPU": 4, "GPU": 8})])
    with pytest.raises(ValueError, match="needs 2 GPUs, the Ray cluster has 0; .*wait_for_resources_s=<seconds>"):
        cluster.wait(resource_need(PretrainConfig(num_workers=2, use_gpu=True)), 0)
    assert cluster.now == 0 and cluster.asked == []
