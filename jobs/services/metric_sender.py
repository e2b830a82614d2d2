"""Training metrics to the tracking server without a training step ever waiting for it.

The training loop hands its points to `MetricSender.put`, which appends them to a bounded buffer and returns; a
daemon thread sends them, oldest first, in batches (`deliver`: one MLflow log_batch each). While the server is
unreachable (restarting, a maintenance window, a network partition) the thread retries the oldest points after a
backoff (`backoff_s`: 1 s doubling up to 15 s, however long the outage) and new points wait behind them, so the
store receives them in the order they were logged once the server is back. One line says the server is unreachable, one
that it is back. A buffer that fills up drops its oldest points (one line when it starts; the count at the end):
the newest figures are the ones a user watching a run needs. A batch the server refuses (an HTTP 4xx: no retry
would cure it) is dropped with one line, so it does not hold up everything logged after it.

`close(timeout_s)` is the end of training: the thread gets that long (on its clock) to send what is left, and the
points that never reached the server are counted in one line and returned.

This module knows nothing of MLflow (jobs/services/tracking.py gives it `deliver` and says which errors are final),
and its clock is injectable: a test covers a ten-minute outage, or a week's, without waiting for it.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Iterable, Protocol

from bertpipe.jobs.services.causes import first_line

log = logging.getLogger("bertpipe.mlflow")

BACKOFF_S = (1.0, 15.0)  # first retry after 1 s, doubling, never more than 15 s apart: a server back is seen soon


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float, interrupt: threading.Event) -> None:
        """Return after `seconds`, or earlier once `interrupt` is set."""


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float, interrupt: threading.Event) -> None:
        interrupt.wait(max(seconds, 0.0))



def duration(seconds: float) -> str:
    seconds = int(round(max(seconds, 0.0)))
    if seconds < 120:
        return f"{seconds} s"
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class MetricSender:
    """A bounded buffer of metric points and the thread that delivers them (see the module docstring).

    `deliver(points)` sends one batch (at most `batch` points, in logging order) or raises; `final(exc)` says whether
    a raised error is the server refusing that batch for good (dropped) rather than the server being away (retried);
    `reason(exc)` is the short cause the unreachable line gives. `tell(line)` shows a line to the user (the driver's
    console); every line also goes to this module's logger."""

    def __init__(self, deliver: Callable[[list], None], capacity: int, *, where: str = "the tracking server",
                 batch: int = 1000, tell: Callable[[str], None] | None = None,
                 final: Callable[[BaseException], bool] = lambda exc: False,
                 reason: Callable[[BaseException], str] = first_line,
                 clock: Clock | None = None, backoff_s: tuple[float, float] = BACKOFF_S, attempt_limit_s: float = 30.0):
        self.deliver, self._final, self._reason, self._tell = deliver, final, reason, tell
        self.where = where
        self.capacity = max(1, int(capacity))
        self.batch = max(1, min(int(batch), self.capacity))
        self.clock: Clock = clock or MonotonicClock()
        self.backoff_s = backoff_s
        # The longest one delivery can take (its request's own timeout): close() waits that much beyond its deadline
        # for a thread that is inside a request, then stops waiting for it.
        self.attempt_limit_s = attempt_limit_s
        self._queue: collections.deque = collections.deque()
        self._inflight: list = []  # the batch being sent: back in the buffer, in front, if it does not arrive
        self._cond = threading.Condition()
        self._wake = threading.Event()  # cuts a backoff short: close() wants a last try now
        self._closing = False
        self._deadline = 0.0
        self._full_told = self._refused_told = False
        # What a test or the end-of-run line reads; changed under the lock.
        self.delivered = self.dropped = self.refused = self.attempts = 0
        self.sending = False  # the thread is inside deliver()
        self.down_since: float | None = None  # clock time of the first failed attempt of the current outage
        self.outages = 0
        self._thread = threading.Thread(target=self._run, name="bertpipe-mlflow-sender", daemon=True)
        self._thread.start()

    @property
    def thread_id(self) -> int | None:
        return self._thread.ident

    def pending(self) -> int:
        """Points logged and not yet taken by the server (the batch in flight included)."""
        with self._cond:
            return len(self._queue) + len(self._inflight)

    def put(self, points: Iterable[Any]) -> None:
        """Queue points for delivery: never waits for the server (a full buffer drops its oldest points)."""
        told = False
        with self._cond:
            self._queue.extend(points)
            # The batch in flight counts (it returns to the buffer if it fails) and is at most `capacity` points,
            # so the excess can always come off the queue.
            over = len(self._queue) + len(self._inflight) - self.capacity
            for _ in range(max(over, 0)):
                self._queue.popleft()
            if over > 0:
                self.dropped += over
                told, self._full_told = not self._full_told, True
            self._cond.notify()
        if told:
            self._say(f"mlflow: the metric buffer is full ({self.capacity:,} points, setting mlflow.buffer_points): "
                      f"the oldest points are dropped until {self.where} takes them again")

    def close(self, timeout_s: float) -> int:
        """The end: the thread gets `timeout_s` (on its clock) to deliver what is left, then stops. Returns how many
        logged points never reached the server (dropped for a full buffer, refused, or still waiting), after one line
        that says so when there are any."""
        with self._cond:
            self._closing = True
            self._deadline = self.clock.now() + max(timeout_s, 0.0)
            self._cond.notify_all()
        self._wake.set()
        self._thread.join(max(timeout_s, 0.0) + self.attempt_limit_s)
        with self._cond:
            left = len(self._queue) + len(self._inflight)
            lost = left + self.dropped + self.refused
        if lost:
            parts = [f"{left:,} still waiting after {duration(timeout_s)} (setting mlflow.flush_timeout_s)"
                     if left else "", f"{self.dropped:,} dropped from the full buffer" if self.dropped else "",
                     f"{self.refused:,} refused by the server" if self.refused else ""]
            self._say(f"mlflow: {lost:,} metric points of this run were not delivered to {self.where}: "
                      + ", ".join(p for p in parts if p))
        return lost

    # -- the thread ------------------------------------------------------------------------------------------------

    def _next_batch(self) -> list | None:
        """The oldest points (at most `batch`), out of the buffer while they are sent; None when the thread is done."""
        with self._cond:
            while not self._queue and not self._closing:
                self._cond.wait()
            if not self._queue:
                return None  # closing, and everything was delivered
            self._inflight = [self._queue.popleft() for _ in range(min(self.batch, len(self._queue)))]
            self.attempts += 1
            self.sending = True
            return self._inflight

    def _run(self) -> None:
        backoff = self.backoff_s[0]
        while (batch := self._next_batch()) is not None:
            try:
                self.deliver(batch)
                error = None
            except Exception as exc:  # noqa: BLE001 - whatever the transport raised: retried or dropped below
                error = exc
            settled = error is None or self._final(error)
            with self._cond:
                self.sending, self._inflight = False, []
                if error is None:
                    self.delivered += len(batch)
                elif settled:
                    self.refused += len(batch)
                else:  # back in front, where a full buffer drops from: the buffer keeps the newest points
                    self._queue.extendleft(reversed(batch))
            if error is None:
                backoff = self.backoff_s[0]
                if self.down_since is not None:
                    self._back(len(batch))
                continue
            if settled:
                self._refused(error, len(batch))
                continue
            if self.down_since is None:
                self._down(error)
            with self._cond:
                closing, left_s = self._closing, self._deadline - self.clock.now()
            if closing and left_s <= 0:
                return  # out of time: close() counts what is left
            self.clock.sleep(min(backoff, left_s) if closing else backoff, self._wake)
            if closing:  # after close()'s own wake-up, backoffs run their length again
                self._wake.clear()
            backoff = min(backoff * 2, self.backoff_s[1])

    def _down(self, error: BaseException) -> None:
        self.down_since = self.clock.now()
        self.outages += 1
        self._say(f"mlflow: {self.where} is unreachable ({self._reason(error)}); training goes on, its metrics wait "
                  f"in a buffer of {self.capacity:,} points and are sent when it is back")

    def _back(self, sent: int) -> None:
        away = self.clock.now() - (self.down_since or self.clock.now())
        self.down_since = None
        with self._cond:
            waiting, dropped = sent + len(self._queue), self.dropped
            self._full_told = False
        lost = f", {dropped:,} points dropped so far (full buffer)" if dropped else ""
        self._say(f"mlflow: {self.where} is back after {duration(away)}: sending the {waiting:,} metric points kept "
                  f"meanwhile{lost}")

    def _refused(self, error: BaseException, count: int) -> None:
        if not self._refused_told:
            self._refused_told = True
            self._say(f"mlflow: {self.where} refused a batch of {count:,} metric points ({self._reason(error)}): "
                      "dropped; later batches are still sent")
        log.debug("mlflow: refused batch", exc_info=error)

    def _say(self, line: str) -> None:
        log.info("%s", line)
        if self._tell is not None:
            try:
                self._tell(line)
            except Exception:  # noqa: BLE001 - the console is a courtesy: the log has the line
                log.debug("could not show the line on the console", exc_info=True)

