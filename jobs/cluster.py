"""Connecting to Ray: a cluster when an address is known, else a local Ray sized so data tasks can run.

Quiet by default: worker output is not forwarded to the console (it stays in Ray's session logs), Ray Data's
per-operator progress bars are off and Ray's own loggers show warnings only; the project prints its own progress.
`verbose` (the CLI's --verbose) turns all of it back on.
"""
from __future__ import annotations

import logging
import os

from bertpipe.jobs import console

log = logging.getLogger(__name__)

WORKER_ENV = {
    # The Rust tokenizer's thread pool deadlocks after fork; Ray workers fork.
    "TOKENIZERS_PARALLELISM": "false",
}
NOISY_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune", "ray.air")


def quiet_ray_loggers(verbose: bool) -> None:
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.ERROR)


def ensure_ray(address: str = "", num_cpus: int = 4, dashboard: bool = True, verbose: bool = False) -> None:
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS", "")
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    level = logging.INFO if verbose else logging.ERROR
    if address:
        # A submitted job already carries its runtime env (see jobs/submit.py); do not override it here.
        log.info("connecting to the Ray cluster at %s", address)
        info = ray.init(address=address, log_to_driver=verbose, logging_level=level)
    else:
        log.info("starting a local Ray with %d logical CPUs", num_cpus)
        # Ray Train + Ray Data start a dozen single-purpose actors (controller, workers, split coordinators...);
        # with the default start-up concurrency (the physical cores) the raylet then warns, repeatedly, about a
        # "large number of worker processes" that is simply what a training run is.
        os.environ.setdefault("RAY_worker_maximum_startup_concurrency", str(max(8, num_cpus)))
        info = ray.init(num_cpus=num_cpus, include_dashboard=dashboard, dashboard_host="127.0.0.1",
                        runtime_env={"env_vars": dict(WORKER_ENV)}, log_to_driver=verbose, logging_level=level)
    quiet_ray_loggers(verbose)
    data = ray.data.DataContext.get_current()
    data.enable_progress_bars = verbose
    data.print_on_execution_start = verbose
    console.ray_started(getattr(info, "dashboard_url", "") or "", address)
