"""What a fan-out stage (GLUE, SQuAD, NER) raises when a requested task or trial failed: the stage is not
committed, and the one-line message names every failed task or trial with its cause (the CLI prints the first
line of a stage's error), and says what was kept for the rerun.

A sweep that silently drops a task reports a GLUE score, or a best learning rate, over a grid the user did not
ask for; so any failure fails the stage, and the finished trials are kept (pipeline/framework/parts.py) for the rerun.
"""
from __future__ import annotations

from bertpipe.jobs.services.causes import first_line, strip_ansi
from bertpipe.pipeline.framework import parts, storage
from bertpipe.pipeline.framework.stage import StageInputError

MAX_CAUSE = 300  # characters per failure: the whole message stays one readable line


class TrialsFailed(RuntimeError):
    """A requested task or trial of the stage failed while running (exit 1)."""


class TasksUnreadable(TrialsFailed, StageInputError):
    """Every failure was a requested task's input (a missing folder, a malformed row): a user error (exit 2)."""


def cause_line(exc: BaseException) -> str:
    """What a trial raised, in one line: the original error out of Ray's wrapper (whose text carries the remote
    traceback), no colour codes (jobs/services/causes.py); the whole traceback is in the run's log file."""
    return first_line(exc)


def one_line(text: str) -> str:
    text = " ".join(strip_ansi(text).split())
    return text if len(text) <= MAX_CAUSE else text[:MAX_CAUSE - 3] + "..."


def requested_failed(what: str, failures: dict[str, str], total: int, stage_uri: str, kept: int,
                     input_only: bool) -> TrialsFailed:
    """The error naming each failed task/trial (`failures`: name -> cause) out of `total` requested `what`."""
    listed = "; ".join(f"{name}: {one_line(cause)}" for name, cause in failures.items())
    text = f"{len(failures)} of {total} requested {what} failed: {listed}"
    if kept:
        text += (f"; {kept} finished trial{'s' if kept > 1 else ''} kept in {storage.join(stage_uri, parts.TRIALS_DIR)}"
                 ", a rerun with the same config retries only the failed ones")
    return (TasksUnreadable if input_only else TrialsFailed)(text)
