"""Waiting for something a real process does (a file, a job's end), with a hang guard: the limit stops a test that
would otherwise wait forever; it is no timing assertion, and is generous for a loaded 2-core machine."""
from __future__ import annotations

import time
from typing import Callable

import pytest


def wait_until(done: Callable[[], object], what: str, limit_s: float = 600, still_running: Callable[[], bool] =
               lambda: True, why_stopped: Callable[[], str] = lambda: "", poll_s: float = 0.2) -> None:
    """Poll `done` until it is true; fail at once if `still_running` turns false, or after `limit_s` (a hang)."""
    give_up = time.monotonic() + limit_s
    while not done():
        if not still_running():
            pytest.fail(f"stopped before {what}: {why_stopped()}")
        if time.monotonic() > give_up:
            pytest.fail(f"hung: no {what} after {limit_s:.0f} s")
        time.sleep(poll_s)
