"""A failed run's quiet ending (Console.end_quietly) mutes the stream handlers that reach a terminal or file (a
library's own, bound to whatever stderr was when it configured logging), not an in-memory capture, and reset() gives
them back: a host process that runs the workflow in-process (a notebook, pytest's log capture) keeps its logs."""
from __future__ import annotations

import io
import logging
import sys

from bertpipe.pipeline.framework.console import Console


def _handlers():
    terminal = logging.StreamHandler(sys.stderr)
    captured = logging.StreamHandler(io.StringIO())
    logger = logging.getLogger("bertpipe.test_quiet_end")
    logger.addHandler(terminal)
    logger.addHandler(captured)
    return logger, terminal, captured


def test_the_quiet_end_mutes_the_terminal_and_not_a_capture(tmp_path):
    logger, terminal, captured = _handlers()
    with open(tmp_path / "elsewhere", "w") as elsewhere:  # a stream that is not sys.stderr now: still muted
        other = logging.StreamHandler(elsewhere)
        logger.addHandler(other)
        _quiet_end_mutes(logger, terminal, captured, other)


def _quiet_end_mutes(logger, terminal, captured, other):
    console = Console(live=True)
    try:
        console.end_quietly()
        record = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "after the failure", None, None)
        assert not terminal.filter(record) and not other.filter(record)
        assert captured.filter(record)
        console.reset()
        assert terminal.filter(record)
    finally:
        console.reset()
        logger.handlers.clear()


def test_reset_takes_back_every_filter_it_added():
    logger, terminal, captured = _handlers()
    console = Console(live=True)
    try:
        console.end_quietly()
        assert console.log_filter in terminal.filters
        console.reset()
        assert console.log_filter not in terminal.filters and console.log_filter not in captured.filters
    finally:
        logger.handlers.clear()
