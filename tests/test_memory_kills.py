"""A task Ray's memory monitor kills is one console line, and the final kill one error line: for real, a local Ray
of its own (a subprocess) whose kill threshold sits 1.5 GB above the memory the machine uses now, and a task that
allocates until it is killed, once (retried: one line) and again (no retry left: the error)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import psutil
import pytest

SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    import psutil
    vm = psutil.virtual_memory()
    os.environ["RAY_memory_usage_threshold"] = f"{(vm.total - vm.available + 1.5e9) / vm.total:.4f}"
    os.environ["RAY_memory_monitor_refresh_ms"] = "100"
    os.environ["RAY_task_oom_retries"] = "1"
    import ray
    from bertpipe.jobs.cluster import ray_errors_to_log
    from bertpipe.jobs.services import causes
    from bertpipe.pipeline.framework import memory_kills
    from bertpipe.pipeline.framework.console import Console

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    ray_errors_to_log()  # as the CLI runs: Ray's pushed errors go to the log, and the watch hears them first

    @ray.remote
    def hog():
        held = []
        for _ in range(48):  # 6 GB at most, a page touched at a time: the monitor sees it grow
            held.append(bytearray(128 * 2**20))
            time.sleep(0.05)
        return len(held)

    console = Console(live=True)
    result = {}
    try:
        with memory_kills.told(console, "pairs", lambda kill: "ADVICE") as kills:
            result["value"] = ray.get(hog.remote())
    except memory_kills.MemoryKilled as exc:
        result["error"] = str(exc)
        result["cause"] = causes.first_line(exc.__cause__)
        result["cause_type"] = type(exc.__cause__).__name__
    result["kills"] = len(kills)
    console.close()
    ray.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
''')


def test_a_task_killed_for_memory_is_one_line_and_the_last_kill_one_error_line():
    vm = psutil.virtual_memory()
    if (vm.total - vm.available + 2.5e9) / vm.total > 0.9:
        pytest.skip("too little free memory to let Ray's monitor kill a 1.5 GB task safely")
    # A short session folder: Ray's socket paths must stay under 108 bytes.
    with tempfile.TemporaryDirectory(prefix="oom", dir="/tmp") as ray_tmp:
        env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": ray_tmp}
        done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    result = json.loads(next(line for line in lines if line.startswith("RESULT "))[len("RESULT "):])
    assert "value" not in result and result["kills"] >= 1, result
    told = [line for line in lines if line.startswith("  pairs: Ray killed")]
    # The first kill, at once, in one line: which task, what it held, the node's memory and Ray's limit, the advice.
    first = told[0]
    assert first.startswith("  pairs: Ray killed a task for memory and retries it: hog (pid "), first
    assert " GB) when the node (" in first and " GB (Ray kills above " in first and first.endswith("%); ADVICE")
    assert len(told) == (1 if result["kills"] == 1 else 2), told
    # The final kill: the OutOfMemoryError becomes one line, and causes.first_line reads the Ray error the same way.
    assert result["cause_type"] == "OutOfMemoryError"
    assert result["error"].startswith("Ray killed a task for memory and has no retry left: hog (pid ")
    assert result["error"].endswith("; ADVICE") and "\n" not in result["error"]
    assert result["cause"].startswith("Ray killed a task for memory: hog (pid ") and "\n" not in result["cause"]
