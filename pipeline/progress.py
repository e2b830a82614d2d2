"""Live progress of long work, shown on the driver.

In a terminal: one tqdm line, refreshed in place. Otherwise (CI, `make run > log`, Ray job logs): a plain line at
most every `PLAIN_EVERY_S` seconds and one when the work ends, so a log stays short and still says how far it got.
Work that runs in Ray tasks or Train workers reports through a `Reporter`, which holds a Ray actor handle and so
can be shipped to them: the driver polls the actor and shows one line however many workers report.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

PLAIN_EVERY_S = 15.0
POLL_S = 0.5
# Off for library use and tests that call stages directly; the CLI turns it on.
ENABLED = {"on": False}


def enable(on: bool = True) -> None:
    ENABLED["on"] = on


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Driver-side display of one piece of work: `set(count, **fields)` as it goes, `close()` at the end.
    `describe(fields) -> str` turns the latest fields (loss, best score...) into the tail of the line."""

    def __init__(self, desc: str, total: float | None, unit: str,
                 describe: Callable[[dict[str, Any]], str] = lambda f: ""):
        self.desc, self.total, self.unit, self.describe = desc, total, unit, describe
        self.count, self.fields = 0.0, {}
        self.started = self.last_plain = time.perf_counter()
        self.first: tuple[float, float] | None = None  # (time, count) of the first progress: rates exclude start-up
        self.bar = None
        if ENABLED["on"] and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=True, file=sys.stderr)

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
            self.bar.set_postfix_str(self.describe(self.fields), refresh=False)
        self.count = count
        if self.bar is None and ENABLED["on"] and time.perf_counter() - self.last_plain >= PLAIN_EVERY_S:
            self._plain()

    def add(self, n: float = 1, **fields: Any) -> None:
        self.set(self.count + n, **fields)

    def line(self, done: bool = False) -> str:
        now = time.perf_counter()
        elapsed = now - self.started
        if self.first is not None and now - self.first[0] > 1.0 and self.count > self.first[1]:
            rate = (self.count - self.first[1]) / (now - self.first[0])
        else:
            rate = self.count / elapsed if elapsed > 0 else 0.0
        done_text = f"{self.count:,.0f}" + (f"/{self.total:,.0f} ({100 * self.count / self.total:.0f}%)"
                                             if self.total else "")
        parts = [f"{self.desc}: {done_text} {self.unit}", self.describe(self.fields), f"{rate:,.1f} {self.unit}/s"]
        if done:
            parts.append(f"done in {_duration(elapsed)}")
        elif self.total and rate > 0:
            parts.append(f"ETA {_duration((self.total - self.count) / rate)}")
        return "  " + " · ".join(p for p in parts if p)

    def _plain(self, done: bool = False) -> None:
        self.last_plain = time.perf_counter()
        state = (self.count, done)
        if state == getattr(self, "_printed", None) or state == (0.0, False):
            return  # nothing new since the last line (a long start-up, or the final update twice)
        self._printed = state
        print(self.line(done), flush=True)

    def _say(self, text: str) -> None:
        """A one-off line about what the work is doing now (compiling...), shown at once, not at the next tick."""
        if self.bar is not None:
            self.bar.write(f"  {self.desc}: {text}", file=sys.stderr)
        elif ENABLED["on"]:
            print(f"  {self.desc}: {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif ENABLED["on"]:
            self._plain(done=True)


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


def _board():
    import ray

    name = f"bertpipe-progress-{ray.get_runtime_context().get_job_id()}"
    return ray.remote(num_cpus=0)(_Board).options(name=name, get_if_exists=True).remote()


@contextmanager
def remote_progress(desc: str, total: float | None, unit: str,
                    describe: Callable[[dict[str, Any]], str] = lambda f: "") -> Iterator[Reporter]:
    """A Reporter for Ray tasks / Train workers, shown on the driver while the block runs."""
    if not ENABLED["on"]:
        yield Reporter(None)
        return
    import ray

    board, key = _board(), f"{desc}-{time.monotonic_ns()}"
    shown = Progress(desc, total, unit, describe)
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(POLL_S):
            try:
                count, fields = ray.get(board.read.remote(key), timeout=10)
            except Exception:  # noqa: BLE001 - a slow poll must never break the work it watches
                continue
            shown.set(count, **fields)

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
