"""A command started as a shell in a terminal starts it: SIGINT at its default.

A run that inherits SIGINT ignored (pytest started as a background job of a non-interactive shell, as CI scripts
do) keeps it ignored, by design (jobs/services/interrupts.py, as `nohup` asks), so a test's Ctrl-C would not reach
it. The reset is done by a tiny program that then execs the command, not in a Popen preexec_fn: that runs Python
between fork and exec, which can deadlock in a child of a threaded process (an xdist worker), and the test would
then wait forever for the command's first line."""
from __future__ import annotations

import sys

_RESET_THEN_EXEC = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                    "os.execv(sys.argv[1], sys.argv[1:])")


def as_in_a_terminal(argv: list[str]) -> list[str]:
    """`argv` (its program an absolute path) run with SIGINT at its default; the process keeps its pid across exec."""
    return [sys.executable, "-c", _RESET_THEN_EXEC, *argv]
