"""The lines `bertpipe run` prints, on the run's console (pipeline/framework/console.py): the project's own lines only
(library chatter goes to the log file unless --verbose). A header saying what runs where, `[stage k/N]` lines, live
progress (pipeline/framework/progress.py), and at the end the summary table, the GLUE scores and where everything is
(jobs/next_steps.py). Commands it prints work as printed in the shell that ran `bertpipe` (`tool`)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.console import Console


def tool(name: str) -> str:
    """How to type `name`, a command installed beside this Python (bertpipe, mlflow), in the shell that ran
    bertpipe: the bare name when that shell finds this one on its PATH, else its path (relative when it lies under
    the current directory: `.venv/bin/mlflow` after `make run`, whose venv is not on PATH)."""
    here = Path(sys.executable).parent / name
    if not here.exists():
        return name
    found = shutil.which(name)
    try:
        if found and os.path.samefile(found, here):
            return name
    except OSError:
        pass
    try:
        return str(here.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(here)


def where(path: str) -> str:
    """A local path as short as it can be typed: relative to the current directory when it lies under it."""
    if storage.is_remote(path):
        return path
    try:
        return str(Path(path).relative_to(Path.cwd())) or "."
    except ValueError:
        return path


def header(console: Console, cfg, config_name: str, tracking_uri: str, selected: list[str], log_path: str,
           log_copy: str = "") -> None:
    console.say(f"bertpipe run · config {config_name} · seed {cfg.seed}")
    console.say(f"  workdir   {cfg.workdir}")
    console.say(f"  stages    {' → '.join(selected)}")
    if tracking_uri.startswith("sqlite:"):
        console.say(f"  mlflow    {tracking_uri}   (open: {tool('mlflow')} ui --backend-store-uri {tracking_uri})")
    elif tracking_uri:
        console.say(f"  mlflow    {tracking_uri}")
    elif storage.is_remote(cfg.workdir) and cfg.mlflow.tracking_uri != "off":
        console.say("  mlflow    OFF: the workdir is remote, so there is no local store to default to; "
                    "set mlflow.tracking_uri (or MLFLOW_TRACKING_URI) to an MLflow server to track this run")
    else:
        console.say("  mlflow    off")
    if log_path:  # a remote workdir's run logs on this machine, and copies its log there when it ends
        console.say(f"  log       {log_path}" + (f"   (copied to {log_copy} when the run ends)" if log_copy else ""))


def ray_started(console: Console, dashboard_url: str, address: str) -> None:
    place = f"cluster {address}" if address else "local Ray"
    console.say(f"  ray       {place}" + (f" · dashboard http://{dashboard_url}" if dashboard_url
                                          else " · no dashboard"))


def stage(console: Console, index: int, total: int, name: str, what: str) -> None:
    console.say(f"[stage {index}/{total}] {name}: {what}")


def amount(rows: int | None, unit: str) -> str:
    """A stage's output in its own unit: `97 documents`, `8,192 vocabulary entries`, `40 steps`."""
    if rows is None:
        return "-"
    return f"{rows:,} {unit}"


def summary(console: Console, rows: list[dict[str, Any]]) -> None:
    """One line per stage: name, ran / skipped, its output in its own unit, seconds (the lines tests and CI parse:
    the first two words of a line that starts with a stage name)."""
    console.say()
    width = max([len("output")] + [len(amount(r["rows"], r.get("unit", "rows"))) for r in rows])
    console.say(f"{'stage':<9} {'status':<8} {'output':>{width}}  time")
    for row in rows:
        took = f"{row['seconds']:.1f} s" if row.get("seconds") is not None else "fresh"
        output = amount(row["rows"], row.get("unit", "rows"))
        console.say(f"{row['stage']:<9} {row['action']:<8} {output:>{width}}  {took}")
