"""Connecting to Ray: a cluster when an address is known, else a local Ray sized so data tasks can run."""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

WORKER_ENV = {
    # The Rust tokenizer's thread pool deadlocks after fork; Ray workers fork.
    "TOKENIZERS_PARALLELISM": "false",
}


def ensure_ray(address: str = "", num_cpus: int = 4, dashboard: bool = False) -> None:
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS", "")
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    runtime_env = {"env_vars": dict(WORKER_ENV)}
    if address:
        # A submitted job already carries its runtime env (see jobs/submit.py); do not override it here.
        log.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address, log_to_driver=True)
    else:
        log.info("starting a local Ray with %d logical CPUs", num_cpus)
        ray.init(num_cpus=num_cpus, include_dashboard=dashboard, runtime_env=runtime_env, log_to_driver=True)
    ray.data.DataContext.get_current().enable_progress_bars = True
