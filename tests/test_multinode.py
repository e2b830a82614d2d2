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

from tiny_bert import save_tiny_bert

from multinode import MultiNodeRay
from waiting import wait_until
from test_faults import BIN, QUIET, assert_closing_lines, cli_env

pytestmark = [pytest.mark.integration, pytest.mark.rig]

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


def pretrain_args(inputs: Path, *extra: str, mlflow: bool = False) -> list[str]:
    return [str(BIN / "bertpipe"), "run", "--workdir", "w", "--only", "pretrain", *QUIET,
            "--set", f"pretrain.input={inputs / 'pairs'}", "--set", f"vocab.path={inputs / 'vocab' / 'vocab.txt'}",
            "--set", f"pretrain.phases={PHASE}", "--set", "pretrain.eval_every_steps=0",
            *([] if mlflow else ["--set", "mlflow.tracking_uri='off'"]), *extra]


class Watched:
    """A running `bertpipe` whose stderr is read as it comes (the console's lines)."""

    def __init__(self, args: list[str], cwd: Path, ray_tmp: Path | None = None):
        self.proc = subprocess.Popen(args, cwd=cwd, env=cli_env(ray_tmp), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        self.out: list[str] = []
        self.arrivals: list[tuple[float, str]] = []  # (time.time() when read, line), both streams
        self.threads = [threading.Thread(target=self._read, args=(s, into), daemon=True)
                        for s, into in ((self.proc.stderr, self.err), (self.proc.stdout, self.out))]
        for t in self.threads:
            t.start()

    def _read(self, stream, into: list[str]) -> None:
        for line in stream:
            self.arrivals.append((time.time(), line))
            into.append(line)

    def wait_for_line(self, pattern: str) -> str:
        def found():
            return next((line for line in self.out + self.err if re.search(pattern, line)), None)

        wait_until(found, f"line matching {pattern!r}", still_running=lambda: self.proc.poll() is None,
                   why_stopped=self.text)
        return found()

    def arrived_at(self, pattern: str) -> float:
        """When the first line matching `pattern` was read."""
        return next(at for at, line in self.arrivals if re.search(pattern, line))

    def finish(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        for t in self.threads:
            t.join(10)
        return code

    def text(self) -> str:
        return "".join(self.out) + "".join(self.err)


@pytest.mark.slow  # ~45 s: keeps the default suite under its 25 minutes
def test_a_plain_run_beside_a_running_cluster_starts_its_own_ray(inputs, tmp_path):
    with MultiNodeRay(head_cpus=1, node_cpus=(1,)):
        run = subprocess.run(pretrain_args(inputs, "--set", "pretrain.max_steps=4",
                                           "--set", "pretrain.checkpoint_every_steps=100"),
                             cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    # Ray's own "When connecting to an existing cluster, num_cpus and num_gpus must not be provided" before
    assert run.returncode == 0, run.stdout + run.stderr
    assert "existing cluster" not in run.stdout + run.stderr
    assert json.loads((tmp_path / "w" / "pretrain" / "metrics.json").read_text())["step"] == 4


_BOARD_PLACES = """
import json, sys
import ray
from ray._private import state
from bertpipe.pipeline.framework.console import Console

ray.init(address=sys.argv[1], log_to_driver=False)
head = next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
places = []
for _ in range(int(sys.argv[2])):
    board = Console().board()
    ray.get(board.read.remote("x"))
    mine = [a for a in state.actors().values() if a["Name"].startswith("bertpipe-progress-") and a["State"] == "ALIVE"]
    places.append(mine[0]["Address"]["NodeID"] == head)
    ray.kill(board)
print(json.dumps(places))
"""


def test_the_progress_board_lives_on_the_head_node(tmp_path):
    """The driver's progress board must outlive any worker node: it is made on the head, every time (a soft
    placement put it on a worker node in 1 of 3 tries, and a lost node then froze the progress and hid the
    restart's line)."""
    with MultiNodeRay(head_cpus=1, node_cpus=(1, 1, 1)) as rig:
        done = subprocess.run([sys.executable, "-c", _BOARD_PLACES, rig.address, "6"], cwd=tmp_path, env=cli_env(),
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True] * 6


def test_pretrain_waits_for_the_node_a_growing_cluster_adds_then_trains(inputs, tmp_path):
    with MultiNodeRay(head_cpus=1) as rig:  # 1 CPU: two 1-CPU workers and a data CPU do not fit
        run = Watched(pretrain_args(inputs, "--set", f"ray.address={rig.address}",
                                    "--set", "ray.wait_for_resources_s=150", "--set", "pretrain.max_steps=4",
                                    "--set", "pretrain.checkpoint_every_steps=100"), tmp_path)
        first = run.wait_for_line(r"pretrain: waiting for 3 CPUs: the cluster has 1 CPUs")
        time.sleep(20)  # an autoscaler takes its time: the wait goes on meanwhile, saying so every 10 s
        rig.add_node(4)
        code = run.finish(240)
    assert code == 0, run.text()
    waits = [line for line in run.text().splitlines() if "pretrain: waiting for" in line]
    assert len(waits) >= 2, run.text()  # one every 10 s
    assert "waiting for nodes to join" in first
    assert json.loads((tmp_path / "w" / "pretrain" / "metrics.json").read_text())["step"] == 4


@pytest.mark.slow  # the run-out arithmetic is tested on a fake clock (tests/test_capacity.py)
def test_a_wait_that_runs_out_ends_in_the_three_lines(inputs, tmp_path):
    with MultiNodeRay(head_cpus=1) as rig:
        run = subprocess.run(pretrain_args(inputs, "--set", f"ray.address={rig.address}",
                                           "--set", "ray.wait_for_resources_s=12", "--set", "pretrain.max_steps=4"),
                             cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=240)
    assert run.returncode == 1, run.stdout + run.stderr  # a stage failure, not a refused configuration
    cause, _ = assert_closing_lines(run.stderr, "stage pretrain failed", "pretrain")
    assert "the Ray cluster has 1 CPUs after waiting 12 s" in cause, cause
    assert "pretrain: waiting for 3 CPUs" in run.stdout


def _a_checkpoint_is_registered(ray_results) -> bool:
    """Ray Train has registered a checkpoint (its manager's snapshot names one): files in a checkpoint_* folder are
    not enough, as a node lost while they are being reported leaves no checkpoint to restart from."""
    for snapshot in ray_results.rglob("checkpoint_manager_snapshot.json"):
        try:
            if json.loads(snapshot.read_text()).get("latest_checkpoint_result"):
                return True
        except (OSError, ValueError):
            pass  # being written
    return False


def test_a_lost_worker_node_is_told_in_one_line_and_training_resumes_on_the_nodes_left(inputs, tmp_path):
    """Two 1-CPU workers on two of three 1-CPU worker nodes (the head's CPU is for data); the node of one of them is
    killed (kill -9 of its raylet) once Ray Train has registered the first checkpoint. Ray Train restarts the workers
    on the nodes left, from the last checkpoint."""
    import mlflow

    with MultiNodeRay(head_cpus=1, node_cpus=(1, 1, 1)) as rig:
        run = Watched(pretrain_args(inputs, "--set", f"ray.address={rig.address}", "--set", "pretrain.max_steps=120",
                                    "--set", "pretrain.checkpoint_every_steps=10", "--set", "pretrain.max_failures=3",
                                    "--set", "pretrain.log_every_steps=2", mlflow=True), tmp_path)
        wait_until(lambda: _a_checkpoint_is_registered(tmp_path / "w" / "ray_results"), "kill point",
                   still_running=lambda: run.proc.poll() is None,
                   why_stopped=run.text, poll_s=0.2)
        killed = rig.kill_train_node()
        code = run.finish(300)
    console = run.text()
    log_file = next((tmp_path / "w" / "logs").glob("run-*.log")).read_text()
    assert code == 0, console
    told = [line for line in console.splitlines() if "; restarted from" in line]
    assert len(told) == 1, f"{console}\n--- the run's log ---\n{log_file}"
    # meanwhile the progress line said so, without the old attempt's ETA
    restarting = [line for line in console.splitlines() if "was lost at step" in line and "restarting the" in line]
    assert all("ETA" not in line for line in restarting), restarting
    m = re.search(r"pretrain: a worker node \(([\d.]+), 1 CPUs\) was lost at step (\d+); restarted from the "
                  r"step-(\d+) checkpoint, attempt 2 of 4$", told[0])
    assert m, told[0]
    lost_at, resumed = int(m.group(2)), int(m.group(3))
    assert resumed % 10 == 0 and 10 <= resumed <= lost_at
    metrics = json.loads((tmp_path / "w" / "pretrain" / "metrics.json").read_text())
    assert metrics["step"] == 120 and metrics["resumed_from_step"] == resumed  # what the workers really resumed
    for noise in ("[state-dump]", "lagging heartbeats", "raylet", "Traceback", "RayTrainWorker"):
        assert noise not in console, console
    # MLflow: the stage's run records the restart (a tag with the line, the restarts series)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'w' / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    restarted = [r for r in runs if "bertpipe.restart.2" in r.data.tags]
    assert len(restarted) == 1 and restarted[0].data.tags["bertpipe.restart.2"].endswith(told[0].split("pretrain: ")[1])
    series = client.get_metric_history(restarted[0].info.run_id, "train/restarts")
    assert [(p.value, p.step) for p in series] == [(1.0, resumed)]
    # the figures of the closing note: from the kill to the first step after the resume, and the steps redone
    told_at = first = None
    for line in log_file.splitlines():
        stamp = re.match(r"(\S+ \S+),(\d+) ", line)
        at = time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) + int(stamp.group(2)) / 1e3 if stamp \
            else None
        if "; restarted from" in line:
            told_at = at
        step = re.search(r"bertpipe.progress: pretrain: (\d+)/120", line)
        if told_at and step and int(step.group(1)) > resumed:
            first = (at, int(step.group(1)))
            break
    assert first, log_file
    print(f"\nnode killed at step ~{lost_at}; resumed from {resumed} ({lost_at - resumed} steps redone); told "
          f"{told_at - killed['at']:.1f} s after the kill; first progress past the checkpoint "
          f"{first[0] - killed['at']:.1f} s after the kill (step {first[1]}); told: {told[0].strip()}")
    print("\n".join(line for line in console.splitlines() if "pretrain:" in line))


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert") / "export")


def test_a_glue_trial_on_a_lost_node_runs_again_elsewhere_and_is_no_task_failure(tiny_bert, tmp_path):
    """One fine-tuning trial (1 CPU) on one of two 1-CPU worker nodes; that node is killed mid-trial. Ray runs the
    trial again on the other node; the stage commits both tasks' results, none reported failed."""
    from bertpipe.jobs.glue.sample import write_sample
    from bertpipe.pipeline.framework.stage import read_manifest

    glue = write_sample(str(tmp_path / "glue"))
    sets = [f"glue.init={tiny_bert}", f"glue.glue_data_dir={glue}", "glue.tasks=[SST-2]",
            "glue.learning_rates=[1e-3]", "glue.num_epochs=40", "glue.max_seq_length=32",
            "mlflow.tracking_uri='off'"]
    with MultiNodeRay(head_cpus=0, node_cpus=(1, 1)) as rig:
        run = Watched([str(BIN / "bertpipe"), "run", "--workdir", "w", "--only", "glue", *QUIET,
                       "--set", f"ray.address={rig.address}", *[a for s in sets for a in ("--set", s)]], tmp_path)
        wait_until(lambda: rig.busy_nodes(), "kill point", still_running=lambda: run.proc.poll() is None,
                   why_stopped=run.text, poll_s=0.5)
        time.sleep(3)  # the trial is training
        assert run.proc.poll() is None, "the trial ended before its node could be killed: " + run.text()
        rig.kill_busy_node()
        code = run.finish(300)
    assert code == 0, run.text()
    manifest = read_manifest(str(tmp_path / "w" / "glue"))
    assert {t: v["status"] for t, v in manifest["extra"]["tasks"].items()} == {"SST-2": "ok"}
    assert "failed" not in run.text() and "raylet" not in run.text()


@pytest.mark.slow
def test_losing_more_nodes_than_max_failures_ends_in_the_three_lines_with_the_resume_command(inputs, tmp_path):
    with MultiNodeRay(head_cpus=1, node_cpus=(1, 1, 1)) as rig:
        run = Watched(pretrain_args(inputs, "--set", f"ray.address={rig.address}", "--set", "pretrain.max_steps=300",
                                    "--set", "pretrain.checkpoint_every_steps=10", "--set", "pretrain.max_failures=0"),
                      tmp_path)
        wait_until(lambda: _a_checkpoint_is_registered(tmp_path / "w" / "ray_results"), "kill point",
                   still_running=lambda: run.proc.poll() is None,
                   why_stopped=run.text, poll_s=0.2)
        rig.kill_train_node()
        code = run.finish(300)
    assert code == 1, run.text()
    assert_closing_lines("".join(run.err), "stage pretrain failed", "pretrain")
    for noise in ("[state-dump]", "lagging heartbeats", "raylet"):
        assert noise not in run.text(), run.text()
