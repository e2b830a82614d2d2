"""Multi-node Ray on one host for integration tests: `with MultiNodeRay(head_cpus=1, node_cpus=[1, 1]) as rig:` runs
tests/ray_rig.py in a process of its own and gives its address, `rig.add_node(cpus)`, `rig.kill_train_node()`.
Every Ray process of the rig is gone when the block ends (the rig's `quit`, then its process group is killed)."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from bertpipe.jobs.cluster import NODE_ENV

HERE = Path(__file__).resolve().parent


class MultiNodeRay:
    def __init__(self, head_cpus: float = 1, node_cpus: tuple[float, ...] = (), start_timeout_s: float = 120):
        self.head_cpus, self.node_cpus, self.start_timeout_s = head_cpus, node_cpus, start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def __enter__(self) -> "MultiNodeRay":
        # The rig answers on a pipe of its own: its stdout is shared with the Ray processes it starts, whose output
        # can land in the middle of an answer's line.
        answers_r, answers_w = os.pipe()
        cmd = [sys.executable, str(HERE / "ray_rig.py"), "--head-cpus", str(self.head_cpus),
               "--answer-fd", str(answers_w)]
        for cpus in self.node_cpus:
            cmd += ["--node-cpus", str(cpus)]
        # Ray's settings of the test process (a token another test's cluster set, an address) are not the rig's:
        # the rig and the `bertpipe` it serves both read the user's own token, as the CLI tests run it.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
        # The nodes run as the project's clusters' do (the image's ENV); a value the test process sets wins (an A/B).
        env.update({k: os.environ.get(k, v) for k, v in NODE_ENV.items()})
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True,
                                     pass_fds=(answers_w,))
        os.close(answers_w)
        self._answers: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read_answers, args=(os.fdopen(answers_r),), daemon=True).start()
        started = self._answer(self.start_timeout_s)
        self.address, self.nodes = started["address"], started["nodes"]
        return self

    def _read_answers(self, answers) -> None:
        with answers:
            for line in answers:
                self._answers.put(json.loads(line))

    def _answer(self, timeout_s: float) -> dict:
        """The rig's next answer."""
        try:
            return self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"the Ray rig did not answer in {timeout_s:.0f} s (exit code {self.proc.poll()})")

    def command(self, line: str, timeout_s: float = 120) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout_s)

    def add_node(self, cpus: float) -> str:
        return self.command(f"add {cpus}")["added"]

    def kill_train_node(self) -> dict:
        return self.command("kill-train-node")

    def kill_node(self, node_id: str) -> dict:
        return self.command(f"kill {node_id}")

    def kill_busy_node(self) -> dict:
        return self.command("kill-busy-node")

    def busy_nodes(self) -> list[str]:
        return self.command("busy")["busy"]

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                self.command("quit", timeout_s=60)
                self.proc.wait(timeout=60)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            pass
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of Ray's is still there
            except ProcessLookupError:
                pass
