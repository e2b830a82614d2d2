"""The run's console: an object the CLI makes once (`Console(live=True)`) and passes down, to the workflow and, in
`StageContext.console`, to every stage. Nothing about the console lives in module globals.

A console that is not live (`Console()`, the default for library use and tests that call a stage) prints what
`say`/`error` are given and nothing else: no progress line, no heartbeat, no quiet ending.

**No silent minute.** On a live console, what the run is doing now is a stack of activities: the stage
(`doing("pretrain: running")`), a step inside it (`doing("registering the model in MLflow")`), a live
`Progress`. A watchdog thread prints the innermost one's line whenever the console has said nothing for
`QUIET_S` seconds, so no step, however long, leaves the console silent for more than `QUIET_S` plus a poll; work
that is quick prints nothing extra. Every line the project prints passes `printed()`, which resets the silence.

**The quiet ending.** While a failed or interrupted run cleans up, the console stays quiet: it ends with the CLI's
three lines. The cleanup meets errors that are not the run's cause and that nobody can act on: MLflow's SQLAlchemy
errors about a store on the disk that filled up, a Ray Data iterator that finds Ray shut down when it is collected
("Exception ignored in ... __del__"), a library thread that dies with Ray. From `end_quietly()` on, every log record
goes to the run's log file only (`log_filter` on each console handler), and so do exceptions Python would print as
"ignored" or as a thread's death; `reset()` (the start of the next run with this console) gives the console back.
"""
from __future__ import annotations

import io
import logging
import re
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from bertpipe.pipeline.framework.progress import POLL_S, Activity, Progress, Reporter, new_board, poll_board
from bertpipe.pipeline.framework.redact import mask

# A terminal colour or cursor code: Ray's task names and tracebacks carry them; a console line or a tag must not.
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

log = logging.getLogger("bertpipe.console")

QUIET_S = 10.0  # the longest a live console stays silent while work goes on (plus one poll)


class Console:
    """Where the project's lines go: `say` (stdout), `error` (stderr), and on a live console progress lines,
    one-off statuses and heartbeats."""

    def __init__(self, live: bool = False, clock: Callable[[], float] = time.monotonic):
        self.live = False
        self.clock = clock  # for the silence (a test's fake clock)
        self.out = None
        self._lock = threading.RLock()
        self._activities: list[Any] = []  # innermost last: Activity or Progress, anything with heartbeat()
        self._last_line = clock()
        self._muted = False  # a failed run cleaning up: no progress line, status or heartbeat
        self._hooks: tuple | None = None  # (sys.unraisablehook, threading.excepthook) while ending quietly
        self._filtered: list[logging.Handler] = []  # the console handlers end_quietly muted, until reset()
        self._board: tuple[tuple[str, str], Any] | None = None  # ((job id, driver's node), the progress board)
        self._stop = threading.Event()
        if live:
            self.go_live()

    def go_live(self) -> None:
        """Progress lines, statuses and heartbeats from now on (the CLI, once its header is out)."""
        if self.live:
            return
        self.live = True
        # Heartbeats go to the console as it was now: a library that redirects sys.stdout for a while (MLflow's
        # model logging runs under redirect_stdout) must not swallow a heartbeat printed meanwhile.
        self.out = sys.stdout
        self.printed()
        threading.Thread(target=self._watch, name="bertpipe-heartbeat", daemon=True).start()

    def close(self) -> None:
        """Stop the heartbeat (a live console made for a while: tests, a program running several workflows)."""
        self._stop.set()

    # -- lines ------------------------------------------------------------------------------------------------------

    def say(self, text: str = "") -> None:
        text = mask(text)  # every console line passes here: a tracking URI's password never reaches the terminal
        print(text, flush=True)
        self.printed()
        log.debug("console: %s", text)

    def error(self, text: str) -> None:
        print(f"bertpipe: {mask(text)}", file=sys.stderr, flush=True)
        self.printed()

    def tell(self, text: str, logger: logging.Logger) -> None:
        """A line for the user now, on a live console, and always in the run's log under the caller's `logger` (a
        stage's lines keep the stage's name there, for whoever filters the log by it)."""
        logger.info("%s", text)
        self.emit(f"  {text}")

    def emit(self, text: str) -> None:
        """A progress line or status: on a live console only, and not while a failed run ends."""
        if not self.live or self._muted:
            return
        print(mask(text), file=self.out or sys.stdout, flush=True)
        self.printed()

    def printed(self) -> None:
        """A line reached the console now: the silence starts again."""
        self._last_line = self.clock()

    def seconds_quiet(self) -> float:
        return self.clock() - self._last_line

    # -- what the run is doing ----------------------------------------------------------------------------------------

    @contextmanager
    def doing(self, label: str) -> Iterator[Activity]:
        """What the run is doing during the block: named on the console if the block keeps it silent for QUIET_S."""
        activity = Activity(label)
        self.push(activity)
        try:
            yield activity
        finally:
            self.pop(activity)

    def progress(self, desc: str, total: float | None, unit: str,
                 describe: Callable[[dict[str, Any]], str] = lambda f: "") -> Progress:
        """A driver-side progress line (close() it at the end)."""
        return Progress(self, desc, total, unit, describe)

    @contextmanager
    def remote_progress(self, desc: str, total: float | None, unit: str,
                        describe: Callable[[dict[str, Any]], str] = lambda f: "",
                        watch: Callable[[float, dict[str, Any]], dict[str, Any]] | None = None
                        ) -> Iterator[Reporter]:
        """A Reporter for Ray tasks / Train workers, shown on the driver while the block runs. `watch(count, fields)`,
        called on every poll, returns fields to show over the workers' (a `status` line of its own:
        jobs/pretrain/attempts.py tells a lost node this way)."""
        if not self.live:
            yield Reporter(None)
            return
        board, key = self.board(), f"{desc}-{time.monotonic_ns()}"
        with poll_board(board, key, self.progress(desc, total, unit, describe), watch):
            yield Reporter(board, key)

    def board(self):
        """The driver's progress board (a Ray actor): what remote work reports into, through Reporters. Made once
        per Ray job and held here: a named actor dies with its last handle, and a block that dropped its handle
        would leave the next one a board that is being destroyed under the same name."""
        import ray

        context = ray.get_runtime_context()
        job = (context.get_job_id(), context.get_node_id())  # job ids restart at 01000000 in every new local Ray
        if self._board is None or self._board[0] != job:
            self._board = (job, new_board(job[0]))
        return self._board[1]

    def push(self, activity: Any) -> None:
        if self.live:
            with self._lock:
                self._activities.append(activity)

    def pop(self, activity: Any) -> None:
        with self._lock:
            if activity in self._activities:
                self._activities.remove(activity)

    def heartbeat(self) -> None:
        """If the console has been quiet for QUIET_S: the innermost activity's line (a live bar refreshes instead)."""
        if not self.live or self._muted:
            return
        with self._lock:  # one heartbeat at a time: the watchdog's and a caller's never both print
            top = self._activities[-1] if self._activities else None
            if top is None:
                return
            bar = getattr(top, "bar", None)
            if bar is not None:  # in a terminal the bar itself shows that time passes
                bar.set_postfix_str(top.describe_all(), refresh=True)
                self.printed()
                return
            if self.seconds_quiet() >= QUIET_S:
                self.emit(top.heartbeat())

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.heartbeat()
            except Exception:  # noqa: BLE001 - the watchdog must never die of one bad line
                pass

    # -- the quiet ending ---------------------------------------------------------------------------------------------

    def log_filter(self, record: logging.LogRecord) -> bool:
        """A console handler's filter: nothing while a failed run ends."""
        return not self._muted

    def end_quietly(self) -> None:
        """From now on, until `reset()`: log records, "ignored" exceptions and threads' deaths go to the log file."""
        if not self.live:
            return
        self._muted = True
        # Libraries' own console handlers too: MLflow's and Ray's loggers do not propagate to the CLI's handler.
        loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                          if isinstance(v, logging.Logger))]
        for handler in {h for logger in loggers for h in logger.handlers}:
            # An in-memory capture (a host process's, e.g. pytest's log capture) is nobody's console: left as is
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler) \
                    and not isinstance(getattr(handler, "stream", None), io.StringIO) \
                    and self.log_filter not in handler.filters:
                handler.addFilter(self.log_filter)
                self._filtered.append(handler)
        if self._hooks is None:
            self._hooks = (sys.unraisablehook, threading.excepthook)
            sys.unraisablehook, threading.excepthook = _unraisable, _thread_died

    def reset(self) -> None:
        """Undo end_quietly: the handlers it muted (other code's too, e.g. a host process's log capture) pass
        records again."""
        self._muted = False
        for handler in self._filtered:
            handler.removeFilter(self.log_filter)
        self._filtered.clear()
        if self._hooks is not None:
            sys.unraisablehook, threading.excepthook = self._hooks
            self._hooks = None


def _unraisable(info) -> None:
    log.info("while the run ended, ignored in %r: %s", info.object, info.exc_value,
             exc_info=(info.exc_type, info.exc_value, info.exc_traceback))


def _thread_died(args) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    log.info("while the run ended, thread %s died: %s", name, args.exc_value,
             exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
