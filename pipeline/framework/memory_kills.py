"""Ray's memory monitor, told: a task killed for memory becomes one console line, not a block in the run's log only.

When a node's used memory passes RAY_memory_usage_threshold (95% by default) the raylet kills the worker of a
running task and Ray retries the task. The only word of it the driver gets is an error Ray pushes to it, printed
by Ray's error-listener thread through `ray._private.worker.print_to_stdstream` (jobs/cluster.py sends those to
the run's log), and, once the task's retries are spent, a `ray.exceptions.OutOfMemoryError` whose text is the same
report: which task (name, pid, the memory it held), the node's used memory and limit, the threshold, the retries
left. `parse` reads that report; `told` watches a block of work for it and says each kill in one line with what the
stage advises, and turns the final error into one line too.
"""
from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

from bertpipe.pipeline.framework.console import ANSI_ESCAPE

log = logging.getLogger(__name__)

_MARK = "killed due to the node running low on memory"
_TASK = re.compile(r"task name=([^,\n]+),|Task (\S+) failed due to oom|\(task ID: \w+, name=([^,\n]+),")
_PID = re.compile(r"\bpid=(\d+)")
_TASK_GB = re.compile(r"(?:actual )?memory used=([\d.]+)\s*GB")
_NODE = re.compile(r"Memory on the node \(IP: ([^,)]+)[^)]*\)[^\n]*? was ([\d.]+)\s*GB(?: used)? / ([\d.]+)\s*GB")
_THRESHOLD = re.compile(r"exceeded threshold of \d+B \(([\d.]+)% of|memory usage threshold of ([\d.]+)")
_RETRIES = re.compile(r"There (?:are|is) (\d+) oom retr(?:y|ies) remaining")


@dataclass(frozen=True)
class MemoryKill:
    task: str  # the task's name as Ray reports it ("MapBatches(pair_block)", "write_cells")
    pid: int | None
    task_gb: float | None  # what the killed worker held
    node: str  # the node's IP
    node_gb: float | None  # the node's used memory then, and its limit
    limit_gb: float | None
    threshold: float | None  # the fraction above which Ray kills
    retries_left: int | None  # None: the report does not say (the final error)

    def describe(self) -> str:
        """"Ray killed a task for memory ...: write_cells (pid 7, 6.2 GB) when the node ... was at 22.8 of 24.0 GB
        (Ray kills above 95%)"."""
        held = f"{self.task_gb:.1f} GB" if self.task_gb is not None else "its memory unknown"
        pid = f"pid {self.pid}, " if self.pid is not None else ""
        node = f"the node ({self.node})" if self.node else "the node"
        if self.node_gb is not None and self.limit_gb is not None:
            node += f" was at {self.node_gb:.1f} of {self.limit_gb:.1f} GB"
        limit = f" (Ray kills above {self.threshold:.0%})" if self.threshold is not None else ""
        what = ("Ray killed a task for memory and retries it" if self.retries_left else
                "Ray killed a task for memory and has no retry left" if self.retries_left == 0 else
                "Ray killed a task for memory")
        return f"{what}: {self.task} ({pid}{held}) when {node}{limit}"


def parse(text: str) -> MemoryKill | None:
    """The kill Ray reports in `text` (a pushed error's line, an OutOfMemoryError's text), None if it reports none."""
    text = ANSI_ESCAPE.sub("", text)
    if _MARK not in text:
        return None
    task = next((g for m in [_TASK.search(text)] if m for g in m.groups() if g), "a task")
    node, threshold, retries = _NODE.search(text), _THRESHOLD.search(text), _RETRIES.search(text)
    pid, task_gb = _PID.search(text), _TASK_GB.search(text)
    percent, fraction = threshold.groups() if threshold else (None, None)
    return MemoryKill(
        task=task.strip(), pid=int(pid.group(1)) if pid else None,
        task_gb=float(task_gb.group(1)) if task_gb else None,
        node=node.group(1).strip() if node else "",
        node_gb=float(node.group(2)) if node else None, limit_gb=float(node.group(3)) if node else None,
        threshold=float(percent) / 100 if percent else float(fraction) if fraction else None,
        retries_left=int(retries.group(1)) if retries else None)


class MemoryKilled(RuntimeError):
    """A task killed for memory with no retry left, said in one line (the Ray error is its __cause__)."""


@contextmanager
def told(console: Any, stage: str, advise: Callable[[MemoryKill], str],
         logger: logging.Logger = log) -> Iterator[list[MemoryKill]]:
    """While the block runs, every task Ray kills for memory is one line on `console` ("pairs: Ray killed a task for
    memory and retries it: ...; <advice>"), the first at once and the others counted in one line at the end; the
    kills are the yielded list. An error the block raises that reports such a kill becomes MemoryKilled with that
    line. Only the driver hears of kills: run the block on it."""
    import ray._private.worker as ray_worker  # no public hook: the pushed errors reach a driver only through it

    kills: list[MemoryKill] = []
    previous = ray_worker.print_to_stdstream

    def notice(data: dict, ignore_prefix: bool = False) -> None:
        try:
            for line in data.get("lines", []):
                kill = parse(str(line))
                if kill is not None:
                    kills.append(kill)
                    if len(kills) == 1:
                        console.tell(f"{stage}: {kill.describe()}; {advise(kill)}", logger)
        except Exception:  # noqa: BLE001 - a report we cannot read must not stop Ray's listener
            logger.info("%s: could not read a report of Ray's", stage, exc_info=True)
        previous(data, ignore_prefix)

    ray_worker.print_to_stdstream = notice
    try:
        yield kills
    except Exception as exc:
        kill = parse(str(exc))
        if kill is None:
            raise
        kill = replace(kill, retries_left=0)  # the error comes once the retries are spent
        raise MemoryKilled(f"{kill.describe()}; {advise(kill)}") from exc
    finally:
        if ray_worker.print_to_stdstream is notice:
            ray_worker.print_to_stdstream = previous
        if len(kills) > 1:
            most = max((k.task_gb for k in kills if k.task_gb is not None), default=None)
            held = f", the largest holding {most:.1f} GB" if most is not None else ""
            console.tell(f"{stage}: Ray killed {len(kills)} tasks for memory in all{held}; "
                         f"{advise(max(kills, key=lambda k: k.task_gb or 0.0))}", logger)
