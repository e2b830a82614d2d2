"""The cause of a failure in one line, for the console and the MLflow error tag.

An error raised inside a Ray task reaches the driver as a RayTaskError whose text is the task's name in ANSI colour
codes followed by the remote traceback; an error inside a Ray Data UDF is wrapped once more (UserCodeException:
"UDF failed to process a data block"), and only the remote traceback's text still names the original error. What a
user needs is that original error: "OSError: [Errno 28] No space left on device", not "ray::MapBatches(...)"; for a
task Ray's memory monitor killed, the task, what it held and the node's memory (pipeline/framework/memory_kills.py),
not the first of Ray's forty lines. The whole traceback stays in the run's log file.
"""
from __future__ import annotations

import re

from bertpipe.pipeline.framework import memory_kills
from bertpipe.pipeline.framework.console import ANSI_ESCAPE

# The last line of a traceback, at column 0: "package.module.Name: message" (pyarrow's ArrowInvalid too), or a bare
# name when the message is empty.
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:: .*|(?<=Error)|(?<=Exception)|(?<=Interrupt))$")
_RAY_WRAPPERS = ("ray.exceptions.", "RayTaskError", "UserCodeException")


def strip_ansi(text: str) -> str:
    return ANSI_ESCAPE.sub("", text)


def from_ray(exc: BaseException) -> bool:
    """A RayTaskError, or another of Ray's errors that carries a worker's traceback as text."""
    return type(exc).__module__.startswith("ray.") or type(exc).__name__.startswith("RayTaskError")


def _task_name(text: str) -> str:
    """"MapBatches(pair_block)" from a RayTaskError's first line "ray::MapBatches(pair_block)() (pid=..)"."""
    m = re.match(r"\s*ray::([^\s]+?)(?:\(\))?\s*(?:\(pid=|$)", text)
    return m.group(1) if m else ""


def _root_error_line(text: str) -> str:
    """The error line that ends the first traceback printed in `text` (Python prints a chain root first), skipping
    Ray's own wrappers; "" when `text` holds no traceback."""
    in_traceback = False
    for line in text.splitlines():
        if line.startswith('  File "'):
            in_traceback = True
        elif in_traceback and _ERROR_LINE.match(line) and not line.startswith(_RAY_WRAPPERS):
            return line.strip()
    return ""


def first_line(exc: BaseException) -> str:
    """What to tell a user about `exc`, in one line without colour codes."""
    if from_ray(exc):  # RayTaskError, and Ray's errors that carry a worker's traceback as text (Ray Train's)
        cause = getattr(exc, "cause", None)
        text = strip_ansi(str(exc))
        where = _task_name(text)
        suffix = f" (in Ray task {where})" if where else ""
        if isinstance(cause, BaseException) and not from_ray(cause):
            # A plain @ray.remote task: Ray hands back the task's own exception object.
            return f"{type(cause).__name__}: {_plain(cause)}{suffix}"
        kill = memory_kills.parse(text)  # an OutOfMemoryError: its text is Ray's report, no traceback
        if kill is not None:
            return kill.describe() + suffix
        root = _root_error_line(text)
        if root:
            return root + suffix
    return _plain(exc)


def _plain(exc: BaseException) -> str:
    # Ray and pyarrow append advice and tracebacks to their messages: the first line is the error.
    text = strip_ansi(str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__
