"""Ray Train settings a pre-training run gives its controller, through the environment variables Ray Train hands
from the driver to its controller and workers when fit() starts. Set only around fit() (the driver's environment is
as it was afterwards) and only where the user set none.

- The report poll. Ray Train's controller takes at most one report per worker per poll: a worker's result queue
  holds one, and its single upload thread waits on that queue before it uploads the next checkpoint. So with
  checkpoints more often than the poll, uploads fall behind the checkpoints written, and a restart resumes from the
  newest complete one, far behind: at Ray's 2 s, ~400 steps (24 s of training) on the multi-node rig with a
  checkpoint every 1.2 s; at 0.5 s, 4 to 71 (benchmarks/README.md, "Goodput under chaos"). The poll is also how
  the controller learns that a worker died or training ended. A poll is one small remote call per worker.
- The worker-group start timeout of an elastic run (pretrain.elastic_start_timeout_s): elastic.py says why.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from bertpipe.jobs.pretrain.config import PretrainConfig

REPORT_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
REPORT_POLL_S = 0.5  # Ray's default: 2.0
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


def controller_settings(cfg: PretrainConfig) -> dict[str, str]:
    """The controller's settings this run asks for."""
    wanted = {REPORT_POLL_ENV: f"{REPORT_POLL_S:g}"}
    if cfg.elastic:
        wanted[START_TIMEOUT_ENV] = f"{cfg.elastic_start_timeout_s:g}"
    return wanted


@contextmanager
def controller_env(cfg: PretrainConfig) -> Iterator[dict[str, str]]:
    """Around a fit(): the settings the environment does not hold yet, set; removed again at the end. Yields what
    it set."""
    added = {name: value for name, value in controller_settings(cfg).items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield added
    finally:
        for name in added:
            os.environ.pop(name, None)
