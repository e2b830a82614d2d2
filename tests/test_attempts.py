"""The driver's watch over pre-training attempts (jobs/pretrain/attempts.py), on fake nodes and a fake clock: a lost
node is told at once in one line with the checkpoint training restarts from and the attempt, the new attempt adds
no second line, a restart no node loss explains is told when the new attempt reports, and MLflow gets each restart.
The real lost node is in tests/test_multinode.py."""
from __future__ import annotations

from bertpipe.jobs.pretrain.attempts import AttemptWatch


class FakeRun:
    def __init__(self):
        self.tags, self.metrics = {}, []

    def set_tag(self, key, value):
        self.tags[key] = value

    def log_metrics(self, metrics, step=None):
        self.metrics.append((metrics, step))


def make_watch(nodes: dict, checkpoint=60):
    clock = {"now": 1000.0}
    run = FakeRun()
    watch = AttemptWatch(3, lambda: checkpoint, run, nodes=lambda: dict(nodes), clock=lambda: clock["now"])
    return watch, run, clock


def test_a_lost_node_is_one_line_at_once_and_its_restart_no_second():
    nodes = {"a": "10.0.0.1, 1 CPUs", "b": "10.0.0.2, 2 CPUs", "c": "10.0.0.3, 2 CPUs"}
    watch, run, clock = make_watch(nodes)
    assert watch(0, {"attempt_started": 1.0, "resumed_from": 0}) == {}
    for step in range(1, 63):
        clock["now"] += 0.5
        assert watch(step, {"attempt_started": 1.0, "eta_s": 30.0}) == {}
    del nodes["b"]
    clock["now"] += 1.0
    shown = watch(62, {"attempt_started": 1.0, "eta_s": 2.0})
    line = ("a worker node (10.0.0.2, 2 CPUs) was lost at step 62; restarting from the step-60 checkpoint, "
            "attempt 2 of 4")
    assert shown["status"] == line and shown["eta_s"] is None  # the old attempt's ETA is no estimate any more
    assert run.tags["bertpipe.restart.2"].endswith(line)
    assert run.metrics == [({"train/restarts": 1}, 62)]
    clock["now"] += 5.0
    assert watch(62, {"attempt_started": 1.0}) == {}  # told once
    assert watch(60, {"attempt_started": 2.0, "resumed_from": 60}) == {"doing": ""}  # the announced restart
    assert watch.lines == [line]


def test_a_restart_without_a_lost_node_is_told_when_the_new_attempt_reports():
    watch, run, clock = make_watch({"a": "10.0.0.1, 4 CPUs"})
    watch(0, {"attempt_started": 1.0})
    for step in range(1, 32):
        clock["now"] += 2
        watch(step, {"attempt_started": 1.0})
    shown = watch(20, {"attempt_started": 2.0, "resumed_from": 20})
    assert shown["status"] == "the workers failed at step 31; restarted from the step-20 checkpoint, attempt 2 of 4"
    watch(20, {"attempt_started": 3.0, "resumed_from": 0})
    assert watch.lines[-1] == ("the workers failed at step 20; restarted from step 0 (no checkpoint yet), "
                               "attempt 3 of 4")
    assert sorted(run.tags) == ["bertpipe.restart.2", "bertpipe.restart.3"]


def test_a_node_that_joins_later_is_watched_and_nodes_are_read_at_most_once_a_second():
    nodes = {"a": "10.0.0.1, 1 CPUs"}
    reads = []
    clock = {"now": 0.0}

    def read():
        reads.append(clock["now"])
        return dict(nodes)

    watch = AttemptWatch(0, lambda: None, FakeRun(), nodes=read, clock=lambda: clock["now"])
    for _ in range(10):
        clock["now"] += 0.25
        watch(1, {"attempt_started": 1.0})
    assert len(reads) == 1 + 3  # at start, then at most one read per second of polls
    nodes["z"] = "10.0.0.9, 8 CPUs"
    clock["now"] += 1
    watch(2, {"attempt_started": 1.0})
    del nodes["z"]
    clock["now"] += 1
    shown = watch(3, {"attempt_started": 1.0})
    assert shown["status"] == ("a worker node (10.0.0.9, 8 CPUs) was lost at step 3; no restart left "
                               "(pretrain.max_failures = 0)")
