"""ray.wait_for_resources_s when the config leaves it unset: a run that joins a cluster (ray.address, RAY_ADDRESS:
what Ray sets for a submitted job's driver) waits CLUSTER_WAIT_S for nodes to join, a run that starts its own local
Ray refuses at once, and a value the user gives wins either way. No Ray is started: the rule is decided when the
config loads, and the refusal is capacity.wait_for's."""
from __future__ import annotations

import pytest

from bertpipe.jobs.config import CLUSTER_WAIT_S, RayConfig, load_config, resolved_wait_s
from bertpipe.jobs.services.capacity import Need, wait_for


@pytest.fixture
def no_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def test_unset_is_a_quarter_hour_on_a_cluster_and_nothing_locally():
    assert CLUSTER_WAIT_S == 900
    assert resolved_wait_s(RayConfig(), environ={}) == 0
    assert resolved_wait_s(RayConfig(address="ray://head:10001"), environ={}) == CLUSTER_WAIT_S
    assert resolved_wait_s(RayConfig(), environ={"RAY_ADDRESS": "auto"}) == CLUSTER_WAIT_S
    assert resolved_wait_s(RayConfig(), environ={"RAY_ADDRESS": ""}) == 0  # an empty variable names no cluster


def test_a_given_value_wins_on_a_cluster_and_locally():
    assert resolved_wait_s(RayConfig(address="ray://head:10001", wait_for_resources_s=0), environ={}) == 0
    assert resolved_wait_s(RayConfig(wait_for_resources_s=0), environ={"RAY_ADDRESS": "auto"}) == 0
    assert resolved_wait_s(RayConfig(wait_for_resources_s=120), environ={}) == 120


def test_load_config_resolves_it_for_every_stage(tmp_path, no_address, monkeypatch):
    assert load_config("tiny", workdir=str(tmp_path)).ray.wait_for_resources_s == 0
    joined = load_config("tiny", ["ray.address=ray://head:10001"], workdir=str(tmp_path))
    assert joined.ray.wait_for_resources_s == CLUSTER_WAIT_S
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # as in a job `bertpipe submit` started
    assert load_config("tiny", workdir=str(tmp_path)).ray.wait_for_resources_s == CLUSTER_WAIT_S
    assert load_config("tiny", ["ray.wait_for_resources_s=30"], workdir=str(tmp_path)).ray.wait_for_resources_s == 30
    # null in a file or a --set is "unset": the rule again, not an error
    assert load_config("tiny", ["ray.wait_for_resources_s=null"],
                       workdir=str(tmp_path)).ray.wait_for_resources_s == CLUSTER_WAIT_S


def test_a_negative_wait_is_still_refused(tmp_path, no_address):
    with pytest.raises(ValueError, match="ray.wait_for_resources_s must be >= 0"):
        load_config("tiny", ["ray.wait_for_resources_s=-1"], workdir=str(tmp_path))


def test_an_explicit_zero_on_a_cluster_refuses_at_once(tmp_path, no_address):
    cfg = load_config("tiny", ["ray.address=ray://head:10001", "ray.wait_for_resources_s=0"], workdir=str(tmp_path))
    need = Need("pretrain", workers=2, cpus_per_worker=1, gpus_per_worker=1)

    def never(*_):
        raise AssertionError("a refusal must not wait, poll again or ask the autoscaler")

    with pytest.raises(ValueError, match="needs 2 GPUs, the Ray cluster has 0"):
        wait_for(need, cfg.ray.wait_for_resources_s, lambda: {"CPU": 8.0}, say=never, sleep=never, ask=never)


def test_the_cluster_default_waits_and_takes_nodes_that_join(tmp_path, no_address):
    """The resolved default reaches the wait: with it, a GPU node that joins after a few polls is taken, where the
    local default (0) would have refused."""
    cfg = load_config("tiny", ["ray.address=ray://head:10001"], workdir=str(tmp_path))
    need = Need("pretrain", workers=1, cpus_per_worker=1, gpus_per_worker=1)
    polls, now = [], [0.0]
    sizes = iter([{"CPU": 4.0}] * 4 + [{"CPU": 8.0, "GPU": 1.0}])

    def resources():
        polls.append(now[0])
        return next(sizes)

    def sleep(seconds):
        now[0] += seconds

    waited = wait_for(need, cfg.ray.wait_for_resources_s, resources, say=lambda line: None,
                      clock=lambda: now[0], sleep=sleep, ask=lambda n: None)
    assert waited > 0 and len(polls) == 5
