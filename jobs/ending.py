"""While a failed or interrupted run cleans up, the console stays quiet: it ends with the CLI's three lines.

The cleanup meets errors that are not the run's cause and that nobody can act on: MLflow's SQLAlchemy errors about a
store on the disk that filled up (logged on MLflow's own console handler), a Ray Data iterator that finds Ray shut
down when it is collected ("Exception ignored in ... __del__"), a library thread that dies with Ray. From `begin()`
on, every log record goes to the run's log file only, and so do exceptions Python would print as "ignored" or as a
thread's death; `reset()` (the start of the next run in the same process) gives the console back. Only where the
CLI turned it on (`enable()`): a program or test that calls the workflow itself keeps its own console.
"""
from __future__ import annotations

import logging
import sys
import threading

from bertpipe.pipeline.framework import progress

log = logging.getLogger("bertpipe.ending")
_enabled = False
_active = False
_saved: tuple | None = None  # (sys.unraisablehook, threading.excepthook) while active


def console_filter(record: logging.LogRecord) -> bool:
    """A console handler's filter: nothing while a failed run ends."""
    return not _active


def enable() -> None:
    global _enabled
    _enabled = True


def begin() -> None:
    global _active, _saved
    if not _enabled:
        return
    _active = True
    progress.mute(True)  # no progress line or heartbeat either
    # Libraries' own console handlers too: MLflow's and Ray's loggers do not propagate to the CLI's handler.
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for handler in {h for logger in loggers for h in logger.handlers}:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler) \
                and console_filter not in handler.filters:
            handler.addFilter(console_filter)
    if _saved is None:
        _saved = (sys.unraisablehook, threading.excepthook)
        sys.unraisablehook, threading.excepthook = _unraisable, _thread_died


def reset() -> None:
    global _active, _saved
    _active = False
    progress.mute(False)
    if _saved is not None:
        sys.unraisablehook, threading.excepthook = _saved
        _saved = None


def _unraisable(info) -> None:
    log.info("while the run ended, ignored in %r: %s", info.object, info.exc_value,
             exc_info=(info.exc_type, info.exc_value, info.exc_traceback))


def _thread_died(args) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    log.info("while the run ended, thread %s died: %s", name, args.exc_value,
             exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
