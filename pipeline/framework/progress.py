"""Live progress of long work, shown on the driver, and the promise that the console is never silent for long.

In a terminal: one tqdm line, refreshed in place. Otherwise (CI, `make run > log`, Ray job logs): plain lines.
Work that runs in Ray tasks or Train workers reports through a `Reporter`, which holds a Ray actor handle and so
can be shipped to them: the driver polls the actor and shows one line however many workers report.

**No silent minute.** While the CLI runs (`enable()`), what the run is doing now is a stack of activities: the
stage (`doing("pretrain: running")`), a step inside it (`doing("registering the model in MLflow")`), a live
`Progress`. A watchdog thread prints the innermost one's line whenever the console has said nothing for
`QUIET_S` seconds (a Progress line carries its count, what the work reports it is doing and the ETA), so no step,
however long, leaves the console silent for more than `QUIET_S` plus a poll; work that is quick prints nothing
extra. Every line the project prints passes `printed()` (jobs/console.py does), which resets the silence.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

log = logging.getLogger("bertpipe.progress")

QUIET_S = 10.0  # the longest the console stays silent while work goes on (plus one poll)
POLL_S = 0.5
# Off for library use and tests that call stages directly; the CLI turns it on.
ENABLED = {"on": False}
_lock = threading.RLock()
_last_line = [time.monotonic()]
_activities: list[Any] = []  # innermost last: Activity or Progress, anything with heartbeat()
_watchdog: list[threading.Thread] = []
# Where heartbeats go: the console as it was when the CLI turned progress on. A library that redirects sys.stdout
# for a while (MLflow's model logging is run under redirect_stdout, its chatter kept off the console) must not
# swallow a heartbeat printed from the watchdog thread meanwhile.
_out: list[Any] = [None]
_muted = [False]  # a failed run cleaning up: its console ends with the CLI's three lines (jobs/ending.py)


def enable(on: bool = True) -> None:
    ENABLED["on"] = on
    _out[0] = sys.stdout if on else None
    if on:
        printed()
        with _lock:
            if not _watchdog or not _watchdog[0].is_alive():
                _watchdog[:] = [threading.Thread(target=_watch, name="bertpipe-heartbeat", daemon=True)]
                _watchdog[0].start()


def mute(on: bool = True) -> None:
    """No progress line, status or heartbeat while `on` (a failed run cleaning up)."""
    _muted[0] = on


def printed() -> None:
    """A line reached the console now: the silence starts again."""
    _last_line[0] = time.monotonic()


def emit(text: str) -> None:
    from bertpipe.pipeline.framework.redact import mask

    if _muted[0]:
        return
    # As every console line: masked, so no credential of a URI in a label reaches the terminal.
    print(mask(text), file=_out[0] or sys.stdout, flush=True)
    printed()


def seconds_quiet() -> float:
    return time.monotonic() - _last_line[0]


def _watch() -> None:
    while True:
        time.sleep(POLL_S)
        try:
            heartbeat()
        except Exception:  # noqa: BLE001 - the watchdog must never die of one bad line
            pass


def heartbeat() -> None:
    """If the console has been quiet for QUIET_S: the innermost activity's line (a live bar refreshes instead)."""
    if not ENABLED["on"] or _muted[0]:
        return
    with _lock:
        top = _activities[-1] if _activities else None
    if top is None:
        return
    bar = getattr(top, "bar", None)
    if bar is not None:  # in a terminal the bar itself shows that time passes
        bar.set_postfix_str(top.describe_all(), refresh=True)
        printed()
        return
    if seconds_quiet() >= QUIET_S:
        emit(top.heartbeat())


def _push(activity: Any) -> None:
    with _lock:
        _activities.append(activity)


def _pop(activity: Any) -> None:
    with _lock:
        if activity in _activities:
            _activities.remove(activity)


class Activity:
    """A step that may take a while, named for the console (see `doing`)."""

    def __init__(self, label: str):
        self.label, self.started = label, time.perf_counter()

    def heartbeat(self) -> str:
        return f"  {self.label} · {_duration(time.perf_counter() - self.started)}"


@contextmanager
def doing(label: str) -> Iterator[Activity]:
    """What the run is doing during the block: named on the console if the block keeps it silent for QUIET_S."""
    activity = Activity(label)
    if not ENABLED["on"]:
        yield activity
        return
    _push(activity)
    try:
        yield activity
    finally:
        _pop(activity)


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Driver-side display of one piece of work: `set(count, **fields)` as it goes, `close()` at the end.
    `describe(fields) -> str` turns the latest fields (loss, best score...) into the tail of the line.

    Fields with a meaning of their own: `status` (printed at once when it changes: a one-off worth a line, such as
    "compiling the model"), `doing` (what the work is busy with now, shown in the next line: "evaluating"),
    `eta_s` + `eta_at` (the work's own estimate of the seconds left, made at wall time `eta_at`: used instead of
    the count-based ETA), `eta_unknown` (no ETA is shown while it is true)."""

    def __init__(self, desc: str, total: float | None, unit: str,
                 describe: Callable[[dict[str, Any]], str] = lambda f: ""):
        self.desc, self.total, self.unit, self.describe = desc, total, unit, describe
        self.count, self.fields = 0.0, {}
        self.started = time.perf_counter()
        self.first: tuple[float, float] | None = None  # (time, count) of the first progress: rates exclude start-up
        self.bar = None
        self.closed = False
        if ENABLED["on"] and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=True, file=sys.stderr)
        if ENABLED["on"]:
            _push(self)

    def set(self, count: float, **fields: Any) -> None:
        status = fields.pop("status", None)
        if status and status != self.fields.get("status"):
            self.fields["status"] = status
            self._say(status)
        self.fields.update(fields)
        if self.first is None and count > 0:
            self.first = (time.perf_counter(), count)
        if self.bar is not None:
            self.bar.update(count - self.count)
            self.bar.set_postfix_str(self.describe_all(), refresh=False)
        moved, self.count = count != self.count, count
        if moved and self.fields.get("eta_s") is not None:
            log.info("%s", self.line().strip())  # work that estimates its own ETA: every estimate in the log file

    def add(self, n: float = 1, **fields: Any) -> None:
        self.set(self.count + n, **fields)

    def eta(self) -> float | None:
        """Seconds left: the work's own estimate when it reports one, else the count at the measured rate; none
        while the work says it cannot know (`eta_unknown`: restarting after a failure, say)."""
        if self.fields.get("eta_unknown"):
            return None
        if self.fields.get("eta_s") is not None:
            left = float(self.fields["eta_s"]) - (time.time() - float(self.fields.get("eta_at", time.time())))
            return max(left, 0.0)
        rate = self.rate()
        if self.total and rate > 0:
            return (self.total - self.count) / rate
        return None

    def rate(self) -> float:
        now = time.perf_counter()
        if self.first is not None and now - self.first[0] > 1.0 and self.count > self.first[1]:
            return (self.count - self.first[1]) / (now - self.first[0])
        elapsed = now - self.started
        return self.count / elapsed if elapsed > 0 else 0.0

    def describe_all(self) -> str:
        doing = self.fields.get("doing") or ""
        return " · ".join(p for p in (doing, self.describe(self.fields)) if p)

    def line(self, done: bool = False) -> str:
        elapsed = time.perf_counter() - self.started
        rate = self.rate()
        done_text = f"{self.count:,.0f}" + (f"/{self.total:,.0f} ({100 * self.count / self.total:.0f}%)"
                                             if self.total else "")
        parts = [f"{self.desc}: {done_text} {self.unit}", "" if done else self.fields.get("doing") or "",
                 self.describe(self.fields), f"{rate:,.1f} {self.unit}/s" if self.count else ""]
        eta = None if done else self.eta()
        if done:
            parts.append(f"done in {_duration(elapsed)}")
        elif eta is not None and self.count:
            parts.append(f"ETA {_duration(eta)}")
        else:
            parts.append(f"{_duration(elapsed)} so far")
        return "  " + " · ".join(p for p in parts if p)

    def heartbeat(self) -> str:
        return self.line()

    def _say(self, text: str) -> None:
        """A one-off line about what the work is doing now (compiling...), shown at once, not at the next tick."""
        if self.bar is not None:
            self.bar.write(f"  {self.desc}: {text}", file=sys.stderr)
            printed()
        elif ENABLED["on"]:
            emit(f"  {self.desc}: {text}")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        _pop(self)
        if self.bar is not None:
            self.bar.close()
            printed()
        elif ENABLED["on"]:
            emit(self.line(done=True))


class Reporter:
    """What remote work holds: `add(n, **fields)` / `set(count, **fields)`, fire-and-forget (no round trip).
    A Reporter without a board (progress off) does nothing."""

    def __init__(self, board=None, key: str = ""):
        self.board, self.key = board, key

    def add(self, n: float = 1, **fields: Any) -> None:
        if self.board is not None:
            self.board.add.remote(self.key, n, fields)

    def set(self, count: float, **fields: Any) -> None:
        if self.board is not None:
            self.board.set.remote(self.key, count, fields)


class _Board:
    """One actor per driver holds every piece of work's count and fields (an actor per progress line would
    start a worker process each)."""

    def __init__(self):
        self.entries: dict[str, tuple[float, dict]] = {}

    def add(self, key: str, n: float, fields: dict) -> None:
        count, old = self.entries.get(key, (0.0, {}))
        self.entries[key] = (count + n, {**old, **fields})

    def set(self, key: str, count: float, fields: dict) -> None:
        self.entries[key] = (count, {**self.entries.get(key, (0.0, {}))[1], **fields})

    def read(self, key: str) -> tuple[float, dict]:
        return self.entries.get(key, (0.0, {}))

    def drop(self, key: str) -> None:
        self.entries.pop(key, None)


def shared_board():
    """The driver's progress board (a Ray actor): what remote work reports into, through Reporters."""
    return _board()


_BOARDS: dict[tuple[str, str], Any] = {}  # (job id, driver's node) -> the driver's board, held for its life


def _board():
    """The driver's board, made once per Ray job and held here: a named actor dies with its last handle, and a
    block that dropped its handle would leave the next one a board that is being destroyed under the same name."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    context = ray.get_runtime_context()
    job = (context.get_job_id(), context.get_node_id())  # job ids restart at 01000000 in every new local Ray
    if job not in _BOARDS:
        # On the head node: a worker node that dies (or an autoscaler removes) must not take the progress of the
        # work with it. Not "the driver's node": several raylets on one host share its IP, and a driver may attach
        # to any. Hard affinity: a soft one placed a zero-CPU actor on another node in 1 of 3 tries (Ray 2.60), and
        # the cluster does not outlive its head anyway.
        head = next((n["NodeID"] for n in ray.nodes()
                     if n.get("Alive") and "node:__internal_head__" in n["Resources"]), None)
        where = NodeAffinitySchedulingStrategy(head, soft=False) if head else "DEFAULT"
        _BOARDS.clear()
        _BOARDS[job] = ray.remote(num_cpus=0)(_Board).options(
            name=f"bertpipe-progress-{job[0]}", get_if_exists=True, scheduling_strategy=where).remote()
    return _BOARDS[job]


@contextmanager
def remote_progress(desc: str, total: float | None, unit: str,
                    describe: Callable[[dict[str, Any]], str] = lambda f: "",
                    watch: Callable[[float, dict[str, Any]], dict[str, Any]] | None = None) -> Iterator[Reporter]:
    """A Reporter for Ray tasks / Train workers, shown on the driver while the block runs. `watch(count, fields)`,
    called on every poll, returns fields to show over the workers' (a `status` line of its own:
    jobs/pretrain/attempts.py tells a lost node this way)."""
    if not ENABLED["on"]:
        yield Reporter(None)
        return
    import ray

    board, key = _board(), f"{desc}-{time.monotonic_ns()}"
    shown = Progress(desc, total, unit, describe)
    stop = threading.Event()

    def poll() -> None:
        count, fields = 0.0, {}
        while not stop.wait(POLL_S):
            try:
                count, fields = ray.get(board.read.remote(key), timeout=10)
            except Exception as exc:  # noqa: BLE001 - a slow poll must never break the work it watches
                log.info("%s: progress poll failed: %s: %s", desc, type(exc).__name__, exc)
            # The watch runs on the last counts when a read fails: a lost node is told even if the board is slow.
            extra = {}
            if watch is not None:
                try:
                    extra = watch(count, fields)
                except Exception:  # noqa: BLE001
                    log.info("%s: the progress watch failed", desc, exc_info=True)
            shown.set(count, **{**fields, **extra})

    thread = threading.Thread(target=poll, name=f"progress-{desc}", daemon=True)
    thread.start()
    try:
        yield Reporter(board, key)
    finally:
        stop.set()
        thread.join()
        try:
            count, fields = ray.get(board.read.remote(key), timeout=10)
            shown.set(count, **fields)
            board.drop.remote(key)
        except Exception:  # noqa: BLE001
            pass
        shown.close()
