"""Elastic pre-training on real Ray nodes (issue 41; tests/multinode.py: a head and worker nodes on this host, each a
real raylet): a run given a range of workers goes on with fewer when a node is lost and grows back when one joins,
each resize told in one line and recorded in MLflow as the world size per step; a node drained with a deadline
(`ray drain-node`, as a cloud autoscaler drains a spot node) makes the run checkpoint before the deadline, so the
restart on the nodes left redoes no step.

The head has no CPU: every 1-CPU worker node holds one worker (an elastic run reads its shards itself: no Ray Data
task needs a CPU), so the cluster's size is the worker count Ray Train's elastic policy sees.
"""
from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from multinode import MultiNodeRay
from test_faults import BIN, cli_env
from test_multinode import Watched, _a_checkpoint_is_registered, pretrain_args
from waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.rig]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from pretrain_helpers import foreign_rig_inputs

    return foreign_rig_inputs(tmp_path_factory.mktemp("elastic-inputs"))

# 24 sequences a step: 2 workers × micro 4 × accumulation 3, or 3 × 4 × 2; an epoch of 800 rows is 33 steps
ELASTIC_PHASE = ("[{max_seq_length: 32, max_predictions_per_seq: 5, global_batch_size: 24, micro_batch_size: 4,"
                 " learning_rate: 1.0e-3, warmup_steps: 2}]")


def mlflow_series(tmp_path, name: str) -> list[tuple[int, float]]:
    """(step, value) of every point of the series, in the order they were logged (steps redone after a restart
    come again)."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'w' / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    points = sorted((p.timestamp, p.step, p.value)
                    for r in runs for p in client.get_metric_history(r.info.run_id, name))
    return [(step, value) for _, step, value in points]


def told(console: str, pattern: str) -> list[re.Match]:
    return [m for m in (re.search(pattern, line) for line in console.splitlines()) if m]


# ~3 min on 2 cores (three attempts of three, two and three workers): in the default tier, so CI runs it
def test_a_range_of_workers_goes_on_with_fewer_when_a_node_is_lost_and_grows_back_when_one_joins(inputs,
                                                                                                 tmp_path):
    with MultiNodeRay(head_cpus=0, node_cpus=(1, 1, 1)) as rig:
        run = Watched(pretrain_args(inputs, "--set", f"ray.address={rig.address}", "--set", "pretrain.max_steps=300",
                                    "--set", f"pretrain.phases={ELASTIC_PHASE}", "--set", "pretrain.num_workers=[2, 3]",
                                    "--set", "pretrain.checkpoint_every_steps=10",
                                    "--set", "pretrain.log_every_steps=2",
                                    "--set", "pretrain.elastic_resize_check_s=5",
                                    "--set", "pretrain.elastic_start_timeout_s=15", mlflow=True), tmp_path)
        wait_until(lambda: _a_checkpoint_is_registered(tmp_path / "w" / "ray_results"), "first checkpoint",
                   still_running=lambda: run.proc.poll() is None, why_stopped=run.text, poll_s=0.2)
        killed = rig.kill_train_node()
        run.wait_for_line(r"going on with 2 workers")
        rig.add_node(1)
        code = run.finish(240)
    console = run.text()
    assert code == 0, console
    print("\n".join(line for line in console.splitlines() if "pretrain:" in line))
    lost = told(console, r"pretrain: a worker node \([\d.]+, 1 CPUs\) was lost at step (\d+): going on with 2 workers "
                         r"from the step-(\d+) checkpoint, accumulation 2 → 3$")
    grew = told(console, r"pretrain: the cluster grew at step (\d+): going on with 3 workers from the step-(\d+) "
                         r"checkpoint, accumulation 3 → 2$")
    assert len(lost) == 1 and len(grew) == 1, console
    assert "elastic, 2 to 3 workers; the global batch stays (2 workers × accumulation 3, 3 workers × accumulation 2)" \
        in console
    metrics = json.loads((tmp_path / "w" / "pretrain" / "metrics.json").read_text())
    assert metrics["step"] == 300 and metrics["resumed_from_step"] == int(grew[0].group(2))
    # MLflow: the world size of every logged window, 3 then 2 then 3 again
    sizes = [int(v) for _, v in mlflow_series(tmp_path, "train/world_size")]
    changes = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
    assert changes == [3, 2, 3], sizes
    reached = int(lost[0].group(1))
    print(f"\nnode killed at step {reached}; step {reached + 1} (a new step, after those redone) "
          f"{first_step_after(tmp_path, killed['at'], reached) - killed['at']:.1f} s after the kill")


# ~2 min on 2 cores
def test_a_node_drained_with_a_deadline_makes_the_run_checkpoint_before_it_and_no_step_is_redone(inputs, tmp_path):
    deadline_s = 20
    # From the first step the test sees to the drain's notice in the loop: the CLI's start, Ray Train's poll of the
    # drain state, the next check: ~5-8 s, 90-150 steps where two workers make 18 steps/s. The run must outlast it
    # many times over on a fast machine.
    steps = 500
    with MultiNodeRay(head_cpus=0, node_cpus=(1, 1)) as rig:
        run = Watched(pretrain_args(inputs, "--set", f"ray.address={rig.address}",
                                    "--set", f"pretrain.max_steps={steps}",
                                    "--set", "pretrain.num_workers=[1, 2]", "--set", "pretrain.log_every_steps=2",
                                    "--set", "pretrain.checkpoint_every_steps=1000",  # the drain's is the only one
                                    "--set", "pretrain.drain_check_every_steps=2",
                                    # Ray Train restarts at the deadline, the drained node still alive: a group
                                    # sized by it would wait for this, and the run outlive the test's wait
                                    "--set", "pretrain.elastic_start_timeout_s=600"), tmp_path)
        wait_until(lambda: _stepping(tmp_path, steps), "training steps", still_running=lambda: run.proc.poll() is None,
                   why_stopped=run.text)
        victim = rig.busy_nodes()[0]
        asked_at = time.time()
        drained = subprocess.run([str(BIN / "ray"), "drain-node", "--address", rig.address, "--node-id", victim,
                                  "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot notice",
                                  "--deadline-remaining-seconds", str(deadline_s)], env=cli_env(),
                                 capture_output=True, text=True, timeout=60)
        assert drained.returncode == 0, drained.stderr
        drained_at = time.time()
        line = run.wait_for_line(notice := r"is being drained \(deadline in \d+ s\): checkpoint at step \d+")
        noticed = run.arrived_at(notice) - asked_at
        time.sleep(max(drained_at + deadline_s - time.time(), 0))
        taken = rig.kill_node(victim)  # the cloud takes the node at its deadline
        code = run.finish(240)
    console = run.text()
    assert code == 0, console
    print("\n".join(line for line in console.splitlines() if "pretrain:" in line))
    at = int(re.search(r"checkpoint at step (\d+)", line).group(1))
    checkpoints = sorted(p.name for p in (tmp_path / "w" / "ray_results").rglob("checkpoint_*") if p.is_dir())
    assert checkpoints, "the drain's checkpoint was reported"
    lost = told(console, r"was lost at step (\d+): going on with 1 worker from the step-(\d+) checkpoint, "
                         r"accumulation 1 → 2$")
    assert len(lost) == 1, console
    assert int(lost[0].group(1)) == int(lost[0].group(2)) == at  # resumed where it stopped: no step redone
    metrics = json.loads((tmp_path / "w" / "pretrain" / "metrics.json").read_text())
    assert metrics["step"] == steps and metrics["resumed_from_step"] == at
    resumed = first_step_after(tmp_path, taken['at'], at) - taken['at']
    print(f"\ndrained at step {at}, told {noticed:.1f} s after `ray drain-node` started "
          f"(it took {drained_at - asked_at:.1f} s); "
          f"first new step {resumed:.1f} s after the node was taken at its deadline")


def _stepping(tmp_path, steps: int) -> bool:
    """The run's log shows optimizer steps (the progress lines the driver logs twice a second)."""
    log_file = next((tmp_path / "w" / "logs").glob("run-*.log"), None)
    return bool(log_file and re.search(rf"bertpipe.progress: pretrain: [1-9]\d*/{steps}", log_file.read_text()))


def first_step_after(tmp_path, since: float, step: int) -> float:
    """When the run's log first showed a step past `step` after time `since` (the driver logs the progress)."""
    log_file = next((tmp_path / "w" / "logs").glob("run-*.log"))
    for line in log_file.read_text().splitlines():
        stamp = re.match(r"(\S+ \S+),(\d+) ", line)
        shown = re.search(r"bertpipe.progress: pretrain: (\d+)/", line)
        if stamp and shown and int(shown.group(1)) > step:
            at = time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) + int(stamp.group(2)) / 1e3
            if at > since:
                return at
    raise AssertionError(f"no step past {step} after the loss in {log_file}")
