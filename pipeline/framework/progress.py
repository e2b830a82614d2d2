"""Progress lines of long work, shown on the driver by the run's console (pipeline/framework/console.py).

In a terminal: one tqdm line, refreshed in place. Otherwise (CI, `make run > log`, Ray job logs): plain lines.
Work that runs in Ray tasks or Train workers reports through a `Reporter`, which holds a Ray actor handle (the
board) and so can be shipped to them: the driver polls the board and shows one line however many workers report.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

log = logging.getLogger("bertpipe.progress")

POLL_S = 0.5


class Activity:
    """A step that may take a while, named for the console (see `doing`)."""

    def __init__(self, label: str):
        self.label, self.started = label, time.perf_counter()

    def heartbeat(self) -> str:
        return f"  {self.label} · {_duration(time.perf_counter() - self.started)}"


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Driver-side display of one piece of work on a console (`Console.progress`, which it is made by and prints
    through: not imported here, as the console module imports this one): `set(count, **fields)` as it goes,
    `close()` at the end.
    `describe(fields) -> str` turns the latest fields (loss, best score...) into the tail of the line.

    Fields with a meaning of their own: `status` (printed at once when it changes: a one-off worth a line, such as
    "compiling the model"), `doing` (what the work is busy with now, shown in the next line: "evaluating"),
    `eta_s` + `eta_at` (the work's own estimate of the seconds left, made at wall time `eta_at`: used instead of
    the count-based ETA), `eta_unknown` (no ETA is shown while it is true: the driver's watch sets it), `paused`
    (no ETA and no count rate while it is true: the work itself says it takes no steps for now, e.g. restarted
    workers setting up, whose count-based rate would only fall)."""

    def __init__(self, console: Any, desc: str, total: float | None, unit: str,
                 describe: Callable[[dict[str, Any]], str] = lambda f: ""):
        self.console = console
        self.desc, self.total, self.unit, self.describe = desc, total, unit, describe
        self.count, self.fields = 0.0, {}
        self.started = time.perf_counter()
        self.first: tuple[float, float] | None = None  # (time, count) of the first progress: rates exclude start-up
        self.bar = None
        self.closed = False
        if console.live and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=True, file=sys.stderr)
        console.push(self)

    def set(self, count: float, **fields: Any) -> None:
        status = fields.pop("status", None)
        if status and status != self.fields.get("status"):
            self.fields["status"] = status
            self._say(status)
        self.fields.update(fields)
        if (self.first is None and count > 0) or count < self.count:  # back to an earlier count: a restart, whose
            self.first = (time.perf_counter(), count)                  # rate is measured from where it resumed
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
        if self.fields.get("eta_unknown") or self.fields.get("paused"):
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
        # No rate while the work says it cannot know its ETA (restarting after a failure): no steps pass meanwhile.
        show_rate = self.count and (done or not (self.fields.get("eta_unknown") or self.fields.get("paused")))
        parts = [f"{self.desc}: {done_text} {self.unit}", "" if done else self.fields.get("doing") or "",
                 self.describe(self.fields), f"{rate:,.1f} {self.unit}/s" if show_rate else ""]
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
            self.console.printed()
        else:
            self.console.emit(f"  {self.desc}: {text}")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.console.pop(self)
        if self.bar is not None:
            self.bar.close()
            self.console.printed()
        else:
            self.console.emit(self.line(done=True))


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


STATUS_SEQ = "status_seq"  # the board counts the statuses it was told: a status is an event, not a state
STATUS_LOG = "status_log"  # and keeps the last ones, numbered: two told between two polls are both printed
KEPT_STATUSES = 16
EARLIER = "earlier_statuses"  # statuses_told_since's: those told since the last poll before the board's last one
LATER = "later_statuses"  # a watch's: the workers' statuses it held back, to be told after its own status


def _merged(old: dict, fields: dict) -> dict:
    merged = {**old, **fields}
    if "status" in fields:
        seq = old.get(STATUS_SEQ, 0) + 1
        merged[STATUS_SEQ] = seq
        merged[STATUS_LOG] = [*old.get(STATUS_LOG, []), (seq, fields["status"])][-KEPT_STATUSES:]
    return merged


def statuses_told_since(fields: dict, seen: int) -> tuple[dict, int]:
    """The board's fields with its `status` only if it was told since the poll that saw status number `seen`, and
    the number now; under EARLIER, the statuses told since then before that one (a drain's notice and its
    checkpoint, told within one poll: the notice would be lost). The board keeps the last status it was told;
    passed on every poll, it would be printed again whenever the driver's own status (a restart's line) came in
    between: a restarted run said "model compiled in 69 s" of the attempt before, as it began compiling again."""
    seq = int(fields.get(STATUS_SEQ, 0))
    earlier = [text for number, text in fields.get(STATUS_LOG, []) if seen < number < seq]
    if seq == seen:
        fields = {k: v for k, v in fields.items() if k != "status"}
    fields = {k: v for k, v in fields.items() if k not in (STATUS_SEQ, STATUS_LOG)}
    return ({**fields, EARLIER: earlier} if earlier else fields), seq


class _Board:
    """One actor per driver holds every piece of work's count and fields (an actor per progress line would
    start a worker process each)."""

    def __init__(self):
        self.entries: dict[str, tuple[float, dict]] = {}

    def add(self, key: str, n: float, fields: dict) -> None:
        count, old = self.entries.get(key, (0.0, {}))
        self.entries[key] = (count + n, _merged(old, fields))

    def set(self, key: str, count: float, fields: dict) -> None:
        self.entries[key] = (count, _merged(self.entries.get(key, (0.0, {}))[1], fields))

    def read(self, key: str) -> tuple[float, dict]:
        return self.entries.get(key, (0.0, {}))

    def drop(self, key: str) -> None:
        self.entries.pop(key, None)


def new_board(job_id: str):
    """The driver's board for one Ray job: on the head node, as a worker node that dies (or an autoscaler removes)
    must not take the progress of the work with it. Not "the driver's node": several raylets on one host share its
    IP, and a driver may attach to any. Hard affinity: a soft one placed a zero-CPU actor on another node in 1 of 3
    tries (Ray 2.60), and the cluster does not outlive its head anyway."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head = next((n["NodeID"] for n in ray.nodes() if n.get("Alive") and "node:__internal_head__" in n["Resources"]),
                None)
    where = NodeAffinitySchedulingStrategy(head, soft=False) if head else "DEFAULT"
    return ray.remote(num_cpus=0)(_Board).options(name=f"bertpipe-progress-{job_id}", get_if_exists=True,
                                                  scheduling_strategy=where).remote()


def poll_updates(fields: dict[str, Any], extra: dict[str, Any]) -> list[dict[str, Any]]:
    """What one poll sets on the progress line, in order: the statuses the board was told before its last one
    (EARLIER), then the board's fields under the watch's `extra`; when both bring a status, the watch's line, the
    statuses the watch held back until it (LATER), then the workers' (a restart told by the driver as the restarted
    workers report their first step: the one would hide the other)."""
    updates: list[dict[str, Any]] = [{"status": text} for text in fields.get(EARLIER, [])]
    fields = {k: v for k, v in fields.items() if k != EARLIER}
    later = [{"status": text} for text in extra.get(LATER, [])]
    merged = {**fields, **{k: v for k, v in extra.items() if k != LATER}}
    if extra.get("status") and fields.get("status") and fields["status"] != extra["status"]:
        return [*updates, merged, *later, {"status": fields["status"]}]
    return [*updates, merged, *later]


@contextmanager
def poll_board(board, key: str, shown: Progress,
               watch: Callable[[float, dict[str, Any]], dict[str, Any]] | None = None) -> Iterator[None]:
    """While the block runs, `shown` follows what remote work reports under `key` (read every POLL_S); `watch`
    adds fields of its own on every poll."""
    import ray

    desc, stop = shown.desc, threading.Event()
    seen = [0]  # the number of the board's last status passed on (statuses_told_since)

    def read() -> tuple[float, dict[str, Any]]:
        count, fields = ray.get(board.read.remote(key), timeout=10)
        fields, seen[0] = statuses_told_since(fields, seen[0])
        return count, fields

    def poll() -> None:
        count, fields = 0.0, {}
        while not stop.wait(POLL_S):
            try:
                count, fields = read()
            except Exception as exc:  # noqa: BLE001 - a slow poll must never break the work it watches
                log.info("%s: progress poll failed: %s: %s", desc, type(exc).__name__, exc)
                fields = {k: v for k, v in fields.items() if k != "status"}  # told on the last poll already
            # The watch runs on the last counts when a read fails: a lost node is told even if the board is slow.
            extra = {}
            if watch is not None:
                try:
                    extra = watch(count, fields)
                except Exception:  # noqa: BLE001
                    log.info("%s: the progress watch failed", desc, exc_info=True)
            for update in poll_updates(fields, extra):
                shown.set(count, **update)

    thread = threading.Thread(target=poll, name=f"progress-{desc}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        try:
            count, fields = read()
            for update in poll_updates(fields, {}):
                shown.set(count, **update)
            board.drop.remote(key)
        except Exception:  # noqa: BLE001
            pass
        shown.close()
