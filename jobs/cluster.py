"""Connecting to Ray: a cluster when an address is known, else a local Ray sized so data tasks can run.

Quiet by default: worker output is not forwarded to the console (it stays in Ray's session logs), Ray Data's
per-operator progress bars are off and Ray's own loggers show warnings only; the project prints its own progress.
`verbose` (the CLI's --verbose) turns all of it back on.

`stop_writers()` is what a failed or interrupted run calls before it removes its temporary files: the Ray this run
started is shut down and its worker processes are gone when it returns, so no task of the run writes after that.
"""
from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import NamedTuple

from bertpipe.jobs.services import interrupts

log = logging.getLogger(__name__)

WORKER_ENV = {
    # The Rust tokenizer's thread pool deadlocks after fork; Ray workers fork.
    "TOKENIZERS_PARALLELISM": "false",
}
# Every Ray node of the project's clusters runs with these (the image's ENV, infra/local/cluster.sh, a local Ray,
# the multi-node test rig); a value already in the environment wins.
# - A call to an actor whose node was just lost (its raylet gone, the cluster not yet declaring the node dead: 13-15 s
#   of health checks) fails only after Ray waits for a death notice that cannot come before then: 1 s, then up to
#   another second for the next check of that wait. Ray Train's controller pays it three times when a node holding a
#   training worker is lost (the failed poll, the backend's shutdown, the workers' shutdown), ~6 s before the new
#   worker group starts. At 0 such a call fails at once, with the same error (KubeRay sets it so for Ray Serve).
# - Ray Train's controller asks the cluster for drained nodes every 5 s by default: a cloud's spot notice gives 30 s
#   (GCP, Azure) before the node goes, and the run needs most of them for its checkpoint. Once a second costs one
#   small GCS call a second.
NODE_ENV = {"RAY_timeout_ms_task_wait_for_death_info": "0", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"}
NOISY_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune", "ray.air")


class RayJoined(NamedTuple):
    """What ensure_ray started or joined: the dashboard's URL, the cluster's address ("" for a local Ray), and how
    this process came to Ray: "local" (it started a local Ray) or "cluster" (it connected)."""

    dashboard_url: str
    address: str
    how: str


def quiet_ray_loggers(verbose: bool) -> None:
    import ray.data  # noqa: F401 - importing it (re)configures its loggers: first, so that what follows sticks

    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.ERROR)
    # Ray Data logs a failed task's error with its user-code traceback on a console handler of its own (the logger
    # does not propagate): the CLI prints the cause in one line instead, the run's log file has the traceback, and
    # Ray's session log (logs/ray-data/) keeps Ray Data's own record.
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.INFO if verbose else logging.CRITICAL + 1)


def ray_errors_to_log() -> None:
    """The errors Ray pushes to every driver (a node's raylet that died, with the last 20 lines of its log) go to the
    run's log file instead of the console, where the CLI says what happened in its own words (a lost node: the
    pre-training attempt watch). Ray prints them from its error-listener thread through the module-level
    `print_to_stdstream`, looked up at each call, whatever log_to_driver says; the log printer that --verbose turns
    on holds the original function, so verbose runs still show them."""
    import ray._private.worker as ray_worker

    def to_log(data: dict, ignore_prefix: bool = False) -> None:
        for line in data.get("lines", []):
            log.info("ray (%s): %s", data.get("pid", "?"), line)

    ray_worker.print_to_stdstream = to_log


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


def ensure_ray(address: str = "", num_cpus: int = 4, dashboard: bool = True,
               verbose: bool = False) -> RayJoined | None:
    """Ray for this process: the cluster at `address` (or RAY_ADDRESS), else a local Ray of `num_cpus`. Returns
    what it started or joined now; None when Ray was up already (whoever started it owns it: a test session, say)."""
    import ray

    if ray.is_initialized():
        return None
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
        for key, value in NODE_ENV.items():  # the local Ray's processes inherit them
            os.environ.setdefault(key, value)
        ensure_private_token()
        # address="local": a Ray of this run's own even where another one runs on the machine (a plain ray.init()
        # would join that one and then refuse num_cpus); connecting to a cluster is what an address is for.
        info = _start_local_ray(address="local", num_cpus=num_cpus, include_dashboard=dashboard,
                                dashboard_host="127.0.0.1", runtime_env={"env_vars": dict(WORKER_ENV)},
                                log_to_driver=verbose, logging_level=level)
    if not verbose:
        ray_errors_to_log()
    interrupts.reinstall()  # ray.init replaced the SIGTERM handler with one that aborts (exit 134)
    quiet_ray_loggers(verbose)
    data = ray.data.DataContext.get_current()
    data.enable_progress_bars = verbose
    data.print_on_execution_start = verbose
    return RayJoined(getattr(info, "dashboard_url", "") or "", address, "cluster" if address else "local")


RAYLET_UNREGISTERED = "timed out during startup"  # Ray's words when its raylet missed its fixed 30 s to register


def _start_local_ray(**init_kwargs):
    """ray.init of a local Ray, once more when its raylet did not register in time.

    Ray waits a fixed 30 s for a new raylet to register with the GCS, and a machine whose cores are all busy (a test
    suite beside the run, a data stage finishing) can take longer to start it: the raylet comes up a moment later,
    but ray.init has given up. The processes that attempt started are stopped (by pid: children this process did
    not have before), then Ray starts once more; a second miss is raised as it is."""
    import psutil
    import ray

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        return ray.init(**init_kwargs)
    except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for it
        if RAYLET_UNREGISTERED not in str(exc):
            raise
        started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        log.warning("the local Ray's raylet did not register within Ray's 30 s (a loaded machine?): stopping the %d "
                    "processes it started and starting Ray once more", len(started))
        for proc in started:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(started, timeout=10)
        ray.shutdown()
        return ray.init(**init_kwargs)


def stop_writers(how: str, timeout_s: float = 30.0) -> None:
    """Stop every task this run has in flight, before its temporary files are removed.

    A local Ray this process started: shut down, waiting for Ray's own processes to exit, then for every worker the
    raylet had started (the processes that run tasks and write files); one still alive after `timeout_s` is killed.
    A cluster: the driver disconnects, which ends the job; the cluster then kills the job's workers itself, soon but
    asynchronously, so a task may still finish a write after this returns (its temporary name is removed by the
    next run of the stage). A Ray this process did not start (`how` is "") is left running: its owner decides.
    `how`: RayJoined.how of what ensure_ray started or joined."""
    import ray

    if not how or not ray.is_initialized():
        return
    workers = _local_ray_descendants() + _warm_processes() if how == "local" else []
    log.info("stopping the run's Ray tasks: ray.shutdown() (%s, %d worker processes)", how, len(workers))
    ray.shutdown(wait_for_processes=True)
    _wait_gone(workers, timeout_s)


def _local_ray_descendants() -> list:
    """Every process below the local Ray's own (raylet, GCS, dashboard...): the raylet's workers among them."""
    import psutil
    import ray

    node = ray._private.worker._global_node  # no public API names the raylet of a local Ray
    procs = []
    for info in (getattr(node, "all_processes", None) or {}).values():
        for proc in info:
            try:
                procs += psutil.Process(proc.process.pid).children(recursive=True)
            except (psutil.Error, AttributeError):
                continue
    return procs


def _warm_processes() -> list:
    """The local Ray's warm processes (jobs/pretrain/warm_start/): started detached, so no descendant of Ray's; each
    ends its forked workers and itself when its raylet exits."""
    import psutil
    import ray

    from bertpipe.jobs.pretrain.warm_start.launcher import warm_process_pids

    sockets = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "sockets")
    procs = []
    for pid in warm_process_pids(sockets):
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return procs


def _wait_gone(procs: list, timeout_s: float) -> None:
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for proc in alive:  # the run's own workers, by pid: nothing else is touched
        log.info("Ray worker %d still running %.0f s after shutdown: killing it", proc.pid, timeout_s)
        try:
            proc.kill()
        except psutil.Error:
            pass
    if alive:
        psutil.wait_procs(alive, timeout=5)
