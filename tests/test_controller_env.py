"""The Ray Train settings a pre-training run hands its controller (jobs/pretrain/controller_env.py): what Ray Train
forwards from the driver while fit() runs, nothing left in the driver's environment afterwards, a user's own value
kept."""
from __future__ import annotations

import os

import pytest
from ray.train.v2._internal.constants import get_env_vars_to_propagate

from bertpipe.jobs.pretrain.controller_env import (REPORT_POLL_ENV, REPORT_POLL_S, START_TIMEOUT_ENV,
                                                   controller_env)
from pretrain_helpers import tiny_config


@pytest.fixture
def clean_env(monkeypatch):
    for name in (REPORT_POLL_ENV, START_TIMEOUT_ENV):
        monkeypatch.delenv(name, raising=False)


def test_ray_train_forwards_the_report_poll_during_the_run_and_the_driver_keeps_nothing(clean_env):
    before = dict(os.environ)
    with controller_env(tiny_config()) as added:
        forwarded = get_env_vars_to_propagate()  # what Ray Train hands its controller at fit()
    assert forwarded[REPORT_POLL_ENV] == f"{REPORT_POLL_S:g}" and float(forwarded[REPORT_POLL_ENV]) < 2.0
    assert START_TIMEOUT_ENV not in forwarded and set(added) == {REPORT_POLL_ENV}
    assert dict(os.environ) == before


def test_an_elastic_run_also_sets_its_start_timeout(clean_env):
    with controller_env(tiny_config(num_workers=(1, 2), elastic_start_timeout_s=12.5)):
        forwarded = get_env_vars_to_propagate()
    assert forwarded[START_TIMEOUT_ENV] == "12.5" and REPORT_POLL_ENV in forwarded
    assert START_TIMEOUT_ENV not in os.environ


def test_a_value_the_user_set_wins_and_stays(clean_env, monkeypatch):
    monkeypatch.setenv(REPORT_POLL_ENV, "3")
    with controller_env(tiny_config()) as added:
        assert get_env_vars_to_propagate()[REPORT_POLL_ENV] == "3"
    assert added == {} and os.environ[REPORT_POLL_ENV] == "3"


def test_a_run_that_fails_leaves_nothing_behind(clean_env):
    with pytest.raises(RuntimeError):
        with controller_env(tiny_config()):
            raise RuntimeError("the run failed")
    assert REPORT_POLL_ENV not in os.environ
