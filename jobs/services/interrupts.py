"""SIGINT, SIGTERM and SIGHUP end a run through an exception, so that every cleanup on the way out runs: the
stage's Ray writers are stopped and its temporary files removed, its MLflow runs are marked KILLED, the workdir
lock is released, and the CLI prints the same three closing lines as for a failed stage (exit 128 + signal).

The exception is a KeyboardInterrupt (`Interrupted`): library code that catches `Exception` lets it through, as it
does Ctrl-C. A second signal during that cleanup ends the process on the spot (os._exit): whoever presses Ctrl-C
twice wants out now, and the next run of the workdir still takes the lock over and closes the MLflow runs this one
left RUNNING (jobs/run_record.py).

A local `ray.init()` installs its own SIGTERM handler (sys.exit(15), which then aborts in Ray's C++ teardown with
status 134): `reinstall()`, called right after Ray starts, puts ours back.
"""
from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_installed: list[int] = []   # the signals install() took over (reinstall() restores only those)
_received: list[int] = []    # signals seen so far in this process


class Interrupted(KeyboardInterrupt):
    """The run was stopped by the signal `signum` (exit_code() says what a shell reports for it)."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def _handler(signum, frame) -> None:
    _received.append(signum)
    if len(_received) > 1:
        # Already cleaning up after the first one: stop now (nothing above runs, not even `finally`).
        os._exit(128 + signum)
    raise Interrupted(signum)


def install() -> None:
    """Take over SIGINT, SIGTERM and SIGHUP (a closed terminal) in the main thread. A signal that is ignored stays
    ignored (`nohup bertpipe run` ignores SIGHUP), and from another thread (an embedding program) nothing changes:
    signals are then their owner's business."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, _handler)
            _installed.append(sig)


def reinstall() -> None:
    """After ray.init(): the signals install() had taken go back to our handler (Ray replaced SIGTERM's)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _installed:
        if signal.getsignal(sig) is not _handler:
            log.debug("re-installing the %s handler (replaced by %r)", signal.Signals(sig).name, signal.getsignal(sig))
            signal.signal(sig, _handler)


def _signum(exc: BaseException) -> int:
    """The signal that ended the run. Ray's blocking calls (ray.get) turn any KeyboardInterrupt raised in them, our
    `Interrupted` included, into a plain one: the signal is then the last this process received, else SIGINT."""
    if isinstance(exc, Interrupted):
        return exc.signum
    return _received[-1] if _received else signal.SIGINT


def exit_code(exc: BaseException) -> int:
    """128 + the signal that ended the run (130 for a Ctrl-C that reached no handler of ours)."""
    return 128 + _signum(exc)


def interrupt_text(exc: BaseException) -> str:
    return f"interrupted by {signal.Signals(_signum(exc)).name}"
