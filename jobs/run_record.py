"""MLflow runs that a run of this workdir opened and could not close: closed as KILLED by the next run.

A driver killed outright (kill -9, an OOM kill, a lost machine) runs no cleanup, and MLflow would show its workflow
run and stage runs as RUNNING for ever. So while a workflow runs, its MLflow run id is recorded in
`<workdir>/.bertpipe.mlflow-runs.json`, and removed once the run is closed. The next run of the workdir, holding the
workdir lock (so the recorded driver is certainly gone), marks every recorded run still RUNNING, and all the runs
below it, KILLED, with a one-line note.

The record never holds a credential: the tracking URI is stored masked, and a recorded run is closed through this
run's own tracking URI when the two name the same store (or through the recorded one when it had nothing to mask).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Callable

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.redact import mask

NAME = ".bertpipe.mlflow-runs.json"
log = logging.getLogger(__name__)


def _uri(workdir: str) -> str:
    return storage.join(workdir, NAME)


def _read(workdir: str) -> list[dict]:
    try:
        data = json.loads(storage.read_text(_uri(workdir)))
    except (OSError, ValueError):
        return []
    runs = data.get("runs") if isinstance(data, dict) else None
    return [r for r in runs or [] if isinstance(r, dict) and isinstance(r.get("run_id"), str)]


def _write(workdir: str, runs: list[dict]) -> None:
    if runs:
        storage.write_text_atomic(_uri(workdir), json.dumps({"runs": runs}, indent=2))
    else:
        storage.delete_file(_uri(workdir))


def remember(workdir: str, tracking_uri: str, run_id: str) -> None:
    """Record a workflow run as open (call right after creating it). Best effort: a record the workdir refuses (a
    full disk) only loses the next run's safety net, and the run still closes its MLflow runs itself."""
    entry = {"run_id": run_id, "tracking_uri": mask(tracking_uri), "host": socket.gethostname(), "pid": os.getpid(),
             "started": time.time()}
    try:
        _write(workdir, [*_read(workdir), entry])
    except OSError as exc:
        log.info("could not record MLflow run %s in %s: %s", run_id, _uri(workdir), exc)


def forget(workdir: str, run_id: str) -> None:
    """The run is closed (FINISHED, FAILED or KILLED reached the store): nothing left for the next run to do."""
    try:
        _write(workdir, [r for r in _read(workdir) if r["run_id"] != run_id])
    except OSError as exc:  # the next run finds the run already closed and leaves it as it is
        log.info("could not update %s: %s", _uri(workdir), exc)


def close_left_running(workdir: str, tracking_uri: str, note: Callable[[str], None]) -> None:
    """Close the runs earlier runs of this workdir left open. Call only while holding the workdir lock. Best effort:
    a store that cannot be reached keeps its record for the next run."""
    from bertpipe.jobs.services.tracking import close_abandoned

    runs, kept = _read(workdir), []
    for entry in runs:
        recorded = entry.get("tracking_uri", "")
        uri = tracking_uri if tracking_uri and mask(tracking_uri) == recorded else (
            recorded if recorded and mask(recorded) == recorded else "")
        if not uri:
            log.info("MLflow run %s of an earlier run is in a store this run cannot reach (%s): left as it is",
                     entry["run_id"], recorded)
            kept.append(entry)
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.get("started") or 0))
        who = f"pid {entry.get('pid', '?')} on {entry.get('host', '?')}, started {when}"
        try:
            marked = close_abandoned(uri, entry["run_id"], f"its driver ({who}) ended without closing it; "
                                                           "marked KILLED by the next run of the workdir")
        except Exception as exc:  # noqa: BLE001 - the store may be down: keep the record for the next run
            log.info("could not close MLflow run %s left by %s: %s", entry["run_id"], who, mask(str(exc)))
            if getattr(exc, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":  # a run deleted since: nothing to close
                kept.append(entry)
            continue
        if marked:
            note(f"marked {len(marked)} MLflow run{'s' if len(marked) > 1 else ''} that an earlier run of this "
                 f"workdir ({who}) left RUNNING as KILLED (workflow run {entry['run_id']})")
    if len(kept) != len(runs):
        try:
            _write(workdir, kept)
        except OSError as exc:  # the closed runs are simply found closed next time
            log.info("could not update %s: %s", _uri(workdir), exc)
