"""Connecting to Ray: a cluster when an address is known, else a local Ray sized so data tasks can run.

Quiet by default: worker output is not forwarded to the console (it stays in Ray's session logs), Ray Data's
per-operator progress bars are off and Ray's own loggers show warnings only; the project prints its own progress.
`verbose` (the CLI's --verbose) turns all of it back on.
"""
from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

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


def ensure_private_token() -> Path | None:
    """The token a local Ray will use, readable by its owner only; returns its path (None: not ours to manage).

    A local ray.init() turns Ray's token auth on and, when no token exists yet, writes ~/.ray/auth_token with the
    process umask: usually 0644, so every local user could read the token and run code on the cluster. Writing
    it first, 0600 and with the same 256 random bits Ray would use, leaves Ray nothing to write; a token file
    that others can read is made private."""
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        return None
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return None  # the user's own token: Ray reads it, nothing is written
    path = Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077 and path.stat().st_uid == os.getuid():
            os.chmod(path, 0o600)
            log.info("made the Ray token %s private (0600): it was readable by other users", path)
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    log.info("wrote a Ray auth token to %s (0600)", path)
    return path


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
        ensure_private_token()
        info = ray.init(num_cpus=num_cpus, include_dashboard=dashboard, dashboard_host="127.0.0.1",
                        runtime_env={"env_vars": dict(WORKER_ENV)}, log_to_driver=verbose, logging_level=level)
    quiet_ray_loggers(verbose)
    data = ray.data.DataContext.get_current()
    data.enable_progress_bars = verbose
    data.print_on_execution_start = verbose
    console.ray_started(getattr(info, "dashboard_url", "") or "", address)
