"""The cluster it is built for, on real Ray nodes (tests/multinode.py: a head and worker nodes on this host, each a
real raylet): a `bertpipe run` beside a running Ray starts its own; pre-training on a cluster that grows waits for
the node an autoscaler adds and trains on it; a wait that runs out ends in the three lines; a worker node killed
mid-training is told in one line and training resumes from the last checkpoint on the nodes left.

Every run is the real `bertpipe` command in a subprocess, on learnable synthetic shards (tests/pretrain_helpers.py)
given as pretrain.input, so no upstream stage runs.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from multinode import MultiNodeRay
from test_faults import BIN, QUIET, assert_closing_lines, cli_env

pytestmark = pytest.mark.integration

PHASE = ("[{max_seq_length: 32, max_predictions_per_seq: 5, global_batch_size: 16, micro_batch_size: 8,"
         " learning_rate: 1.0e-3, warmup_steps: 2}]")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    from pretrain_helpers import make_inputs

    root = tmp_path_factory.mktemp("multinode-inputs")
    make_inputs(root, lengths=(32,), rows_per_shard=400, num_shards=2, heldout_rows=160)
    (root / "pairs" / "_MANIFEST.json").unlink()  # shards from anywhere: no manifest of ours
    return root


def pretrain_args(inputs: Path, *extra: str) -> list[str]:
    return [str(BIN / "bertpipe"), "run", "--workdir", "w", "--only", "pretrain", *QUIET,
            "--set", f"pretrain.input={inputs / 'pairs'}", "--set", f"vocab.path={inputs / 'vocab' / 'vocab.txt'}",
            "--set", f"pretrain.phases={PHASE}", "--set", "pretrain.eval_every_steps=0",
            "--set", "mlflow.tracking_uri='off'", *extra]


class Watched:
    """A running `bertpipe` whose stderr is read as it comes (the console's lines)."""

    def __init__(self, args: list[str], cwd: Path, ray_tmp: Path | None = None):
        self.proc = subprocess.Popen(args, cwd=cwd, env=cli_env(ray_tmp), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        self.out: list[str] = []
        self.threads = [threading.Thread(target=self._read, args=(s, into), daemon=True)
                        for s, into in ((self.proc.stderr, self.err), (self.proc.stdout, self.out))]
        for t in self.threads:
            t.start()

    def _read(self, stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def wait_for_line(self, pattern: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.out + self.err:
                if re.search(pattern, line):
                    return line
            assert self.proc.poll() is None, self.text()
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r} in {timeout_s:.0f} s:\n{self.text()}")

    def finish(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        for t in self.threads:
            t.join(10)
        return code

    def text(self) -> str:
        return "".join(self.out) + "".join(self.err)


def test_a_plain_run_beside_a_running_cluster_starts_its_own_ray(inputs, tmp_path):
    with MultiNodeRay(head_cpus=1, node_cpus=(1,)):
        run = subprocess.run(pretrain_args(inputs, "--set", "pretrain.max_steps=4",
                                           "--set", "pretrain.checkpoint_every_steps=100"),
                             cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    # Ray's own "When connecting to an existing cluster, num_cpus and num_gpus must not be provided" before
    assert run.returncode == 0, run.stdout + run.stderr
    assert "existing cluster" not in run.stdout + run.stderr
    assert json.loads((tmp_path / "w" / "pretrain" / "metrics.json").read_text())["step"] == 4


def test_pretrain_waits_for_the_node_a_growing_cluster_adds_then_trains(inputs, tmp_path):
    with MultiNodeRay(head_cpus=1) as rig:  # 1 CPU: two 1-CPU workers and a data CPU do not fit
        run = Watched(pretrain_args(inputs, "--set", f"ray.address={rig.address}",
                                    "--set", "ray.wait_for_resources_s=150", "--set", "pretrain.max_steps=4",
                                    "--set", "pretrain.checkpoint_every_steps=100"), tmp_path)
        first = run.wait_for_line(r"pretrain: waiting for 3 CPUs: the cluster has 1 CPUs", 120)
        time.sleep(20)  # an autoscaler takes its time: the wait goes on meanwhile, saying so every 10 s
        rig.add_node(4)
        code = run.finish(240)
    assert code == 0, run.text()
    waits = [line for line in run.text().splitlines() if "pretrain: waiting for" in line]
    assert len(waits) >= 2, run.text()  # one every 10 s
    assert "waiting for nodes to join" in first
    assert json.loads((tmp_path / "w" / "pretrain" / "metrics.json").read_text())["step"] == 4


def test_a_wait_that_runs_out_ends_in_the_three_lines(inputs, tmp_path):
    with MultiNodeRay(head_cpus=1) as rig:
        run = subprocess.run(pretrain_args(inputs, "--set", f"ray.address={rig.address}",
                                           "--set", "ray.wait_for_resources_s=12", "--set", "pretrain.max_steps=4"),
                             cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=240)
    assert run.returncode == 1, run.stdout + run.stderr  # a stage failure, not a refused configuration
    cause, _ = assert_closing_lines(run.stderr, "stage pretrain failed", "pretrain")
    assert "the Ray cluster has 1 CPUs after waiting 12 s" in cause, cause
    assert "pretrain: waiting for 3 CPUs" in run.stdout
