"""What `bertpipe run` prints: the project's own lines only (library chatter goes to the log file unless
--verbose). A header saying what runs where, `[stage k/N]` lines, live progress (pipeline/progress.py), and at the
end the summary table and the GLUE table."""
from __future__ import annotations

import logging
import sys
from typing import Any

from bertpipe.pipeline.redact import mask

log = logging.getLogger("bertpipe")


def say(text: str = "") -> None:
    text = mask(text)  # every console line passes here: a tracking URI's password never reaches the terminal
    print(text, flush=True)
    log.debug("console: %s", text)


def header(cfg, config_name: str, tracking_uri: str, selected: list[str], log_path: str) -> None:
    say(f"bertpipe run · config {config_name} · seed {cfg.seed}")
    say(f"  workdir   {cfg.workdir}")
    say(f"  stages    {' → '.join(selected)}")
    if tracking_uri.startswith("sqlite:"):
        say(f"  mlflow    {tracking_uri}   (open: mlflow ui --backend-store-uri {tracking_uri})")
    elif tracking_uri:
        say(f"  mlflow    {tracking_uri}")
    elif "://" in cfg.workdir and cfg.mlflow.tracking_uri != "off":
        say("  mlflow    OFF: the workdir is remote, so there is no local store to default to; "
            "set mlflow.tracking_uri (or MLFLOW_TRACKING_URI) to an MLflow server to track this run")
    else:
        say("  mlflow    off")
    if log_path:
        say(f"  log       {log_path}")


def ray_started(dashboard_url: str, address: str) -> None:
    where = f"cluster {address}" if address else "local Ray"
    say(f"  ray       {where}" + (f" · dashboard http://{dashboard_url}" if dashboard_url else " · no dashboard"))


def stage(index: int, total: int, name: str, what: str) -> None:
    say(f"[stage {index}/{total}] {name}: {what}")


def summary(rows: list[dict[str, Any]]) -> None:
    """One line per stage: name, ran / skipped, rows, seconds (the lines tests and CI parse)."""
    say()
    say(f"{'stage':<9} {'status':<8} {'rows':>9}  time")
    for row in rows:
        took = f"{row['seconds']:.1f} s" if row.get("seconds") is not None else "fresh"
        say(f"{row['stage']:<9} {row['action']:<8} {row['rows'] if row['rows'] is not None else '-':>9}  {took}")


def glue_table(markdown: str) -> None:
    say()
    for line in markdown.strip().splitlines():
        say(line)


def error(text: str) -> None:
    print(f"bertpipe: {mask(text)}", file=sys.stderr, flush=True)
