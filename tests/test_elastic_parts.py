"""The parts of elastic pre-training that need no cluster (issue 41): the shared data order and its global position
(no sequence of an epoch lost or trained twice across resizes), the worker counts that hold the global batch, the
resume rule, the resize lines of the attempt watch, the driver's rate over all workers' sequences, and the drain's
checkpoint decision on a fake clock; and the one Ray call the restart policy adds (which nodes are being drained),
on real nodes. Training on a real cluster is in tests/test_elastic_multinode.py."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from bertpipe.jobs.pretrain import drain
from bertpipe.jobs.pretrain.attempts import AttemptWatch
from bertpipe.jobs.pretrain.checkpointing.resume import Position, resume_plan
from bertpipe.jobs.pretrain.config import PhaseConfig, PretrainConfig
from bertpipe.jobs.pretrain.data import shared_order
from bertpipe.jobs.pretrain.elastic import whole_batch_world, worlds_line
from bertpipe.jobs.pretrain.metrics.rate import ProgressFigures, sequences_at
from bertpipe.jobs.pretrain.runs import layout_of
from test_attempts import FakeRun

FILES = {f"f{i}": 37 + 5 * i for i in range(4)}  # rows per shard: uneven, so global batches span files


def fake_read(uri: str) -> dict[str, np.ndarray]:
    """Rows whose input_ids name them: (file, row) -> a unique id, lengths varied."""
    base = int(uri[1:]) * 1000
    ids = np.empty(FILES[uri], dtype=object)
    for r in range(FILES[uri]):
        ids[r] = np.full(3 + (r * 7) % 11, base + r, dtype=np.int64)
    return {"input_ids": ids, "segment_b_start": np.ones(FILES[uri], np.int16),
            "next_sentence_label": np.zeros(FILES[uri], np.int8)}


def trained(world: int, steps: range, micro: int = 2, global_batch: int = 12) -> list[int]:
    """Row ids every rank of `world` trains over optimizer steps `steps` of epoch 0 (the global position: steps
    before them done)."""
    rows = []
    for rank in range(world):
        batches = shared_order.global_batches(list(FILES), 7, 0, 0, global_batch, skip=steps.start, read=fake_read)
        for place, mb in shared_order.rank_micro_batches(batches, steps.start, rank, world, micro):
            if place // (global_batch // micro) in steps:
                rows += [int(r[0]) for r in mb["input_ids"]]
    return rows


def test_resizes_mid_epoch_train_every_sequence_once_in_the_same_global_batches():
    total = sum(FILES.values()) // 12  # global batches in the epoch
    fixed = trained(2, range(total))
    # 2 workers, then 3 (a node joined), then 1 (two lost), then 6: the position is the global count
    resized = (trained(2, range(0, 4)) + trained(3, range(4, 9)) + trained(1, range(9, 11))
               + trained(6, range(11, total)))
    assert len(resized) == len(set(resized)) == total * 12  # none twice, none left out (but the epoch's short tail)
    assert sorted(resized) == sorted(fixed)
    # each global batch holds the same rows on any worker count
    for step in (0, 5, total - 1):
        assert sorted(trained(1, range(step, step + 1))) == sorted(trained(6, range(step, step + 1)))


def test_the_shared_order_is_another_one_each_epoch_and_micro_batches_are_sorted_by_length():
    first = next(shared_order.global_batches(list(FILES), 7, 0, 0, 12, read=fake_read))
    other = next(shared_order.global_batches(list(FILES), 7, 0, 1, 12, read=fake_read))
    assert [int(r[0]) for r in first["input_ids"]] != [int(r[0]) for r in other["input_ids"]]
    lengths = [len(r) for r in first["input_ids"]]
    assert lengths == sorted(lengths)
    assert shared_order.sequences_through(place=5, micro=2, global_batch=12) == 12  # the 6th micro-batch ends it
    assert shared_order.sequences_through(place=6, micro=2, global_batch=12) == 24


def elastic(workers, global_batch=24, micro=4, max_steps=100, **kw) -> PretrainConfig:
    return PretrainConfig(num_workers=workers, max_steps=max_steps, phases=(
        PhaseConfig(max_seq_length=32, max_predictions_per_seq=5, global_batch_size=global_batch,
                    micro_batch_size=micro),), **kw)


def test_a_range_keeps_the_counts_that_split_the_global_batch_and_takes_the_largest_below_what_fits():
    cfg = elastic((2, 5))
    assert cfg.elastic and (cfg.min_workers, cfg.max_workers) == (2, 5)
    assert cfg.whole_batch_worlds() == [2, 3]  # 24 = 4 × workers × accumulation: 4 and 5 workers cannot
    assert [whole_batch_world(n, cfg.whole_batch_worlds()) for n in (1, 2, 3, 4, 5)] == [0, 2, 3, 3, 3]
    line = worlds_line(cfg)
    assert "2 workers × accumulation 3, 3 workers × accumulation 2" in line and "4, 5 workers would not" in line
    with pytest.raises(ValueError, match="no worker count in the range"):
        elastic((4, 5))
    with pytest.raises(ValueError, match="range"):
        elastic((3, 2))
    assert not elastic(2).elastic


def test_a_shared_position_goes_on_exactly_on_another_count_and_a_fixed_one_ends_its_epoch():
    cfg = elastic((1, 3))
    taken = Position(step=4, epoch=0, batch=24, sequences=96, dealt=4, shared=1)
    then, now = layout_of(2, [4], 1, (1, 3)), layout_of(3, [4], 1, (1, 3))
    plan = resume_plan(taken, then, now, cfg, {"train_32": 400})
    assert plan.position == taken and plan.left_out == 0 and plan.repartition
    assert "goes on at its sequence 96" in plan.carries
    fixed = resume_plan(taken, then, layout_of(3, [4], 1), elastic(3), {"train_32": 400})
    assert fixed.position == Position(4, 0, 1) and fixed.left_out == 384 - 96


def test_a_resize_is_one_line_with_the_worker_count_and_the_accumulation_and_a_grow_is_told_too():
    nodes = {"a": "10.0.0.1, 1 CPUs", "b": "10.0.0.2, 1 CPUs", "c": "10.0.0.3, 1 CPUs"}
    clock = {"now": 0.0}
    run = FakeRun()
    watch = AttemptWatch(3, run, nodes=lambda: dict(nodes), clock=lambda: clock["now"])
    watch(0, {"attempt_started": 1.0, "resumed_from": 0, "workers": 3, "accumulation": 2})
    for step in range(1, 13):
        clock["now"] += 1
        watch(step, {"attempt_started": 1.0})
    del nodes["b"]
    clock["now"] += 2
    watch(12, {"attempt_started": 1.0})
    shown = watch(10, {"attempt_started": 2.0, "resumed_from": 10, "workers": 2, "accumulation": 3})
    assert shown["status"] == ("a worker node (10.0.0.2, 1 CPUs) was lost at step 12: going on with 2 workers from "
                               "the step-10 checkpoint, accumulation 2 → 3")
    for step in range(11, 21):
        clock["now"] += 1
        watch(step, {"attempt_started": 2.0})
    grown = watch(20, {"attempt_started": 3.0, "resumed_from": 20, "workers": 3, "accumulation": 2})
    assert grown["status"] == ("the cluster grew at step 20: going on with 3 workers from the step-20 checkpoint, "
                               "accumulation 3 → 2")
    assert len(watch.lines) == 2 and run.metrics == [({"train/restarts": 1}, 10)]  # a grow is no failure


def test_the_rate_counts_every_workers_sequences_over_its_window_and_starts_again_after_a_restart():
    cfg = elastic((1, 3), global_batch=24)
    figures = ProgressFigures(cfg, window_s=10.0)
    assert figures({"loss": 5.0}) == "loss 5.000"
    for step in range(1, 21):  # a step a second, then the last steps twice as fast
        figures({"loss": 4.0, "step_at": [step, float(step if step <= 10 else 10 + (step - 10) / 2)]})
    # the window covers the last 10 s: steps 5 (t = 5) to 20 (t = 15), 15 global batches of 24
    assert figures({"loss": 4.0, "step_at": [20, 15.0]}) == f"loss 4.000 · {15 * 24 / 10:.1f} seq/s"
    # a restart (from the step-20 checkpoint): the time restarting is in no window; the last attempt's step is not
    # the new one's
    assert figures({"loss": 4.0, "step_at": [20, 15.0], "attempt_started": 40.0}) == "loss 4.000"
    assert figures({"loss": 4.0, "step_at": [21, 50.0], "attempt_started": 40.0}) == "loss 4.000"
    assert figures({"loss": 4.0, "step_at": [23, 51.0], "attempt_started": 40.0}) == "loss 4.000 · 48.0 seq/s"
    assert sequences_at(PretrainConfig(max_steps=10, phase1_fraction=0.5), 7) == 5 * 32 + 2 * 8


def test_the_drain_checkpoint_waits_while_the_deadline_is_far_and_is_taken_once_it_comes_near():
    # a 4 s checkpoint, looks 1 s apart: due within 2 × 4 + 1 + margin of the deadline
    deadline_ms = 100_000
    due_at = deadline_ms / 1000 - (2 * 4 + 1 + drain.MARGIN_S)
    assert not drain.checkpoint_due(deadline_ms, due_at - 0.5, 4.0, 1.0)
    assert drain.checkpoint_due(deadline_ms, due_at, 4.0, 1.0)
    assert drain.checkpoint_due(None, 0.0, 4.0, 1.0)  # no deadline: at once

    class Info:
        deadline_ms, preempted_node_ids, preempted_ranks = 100_000, ["ab12cd34ef"], [1]

    told = drain.notice(Info, 40, 90.0, 4.0, 1.0)
    assert told.due and told.hold_until_s == 100.0 + drain.HOLD_PAST_DEADLINE_S
    assert told.line == ("node ab12cd34 (rank 1) is being drained (deadline in 10 s): checkpoint at step 40, then "
                         "the workers wait for Ray Train to go on without it")
    clock = {"now": 0.0}
    drain.hold_until_restart(5.0, clock=lambda: clock["now"],
                             sleep=lambda s: clock.__setitem__("now", clock["now"] + s))
    assert clock["now"] == 5.0


def test_a_start_or_a_grow_counts_only_the_nodes_whose_raylet_answers():
    """Ray Train restarts the group seconds after a worker's node is lost, while the cluster still holds the node
    alive (its health checks take ~15 s): sized by that node, the group would wait for it until the start times out,
    and a resize check would grow the running group toward it (the rig's range test did: "grew" 8 s after the kill,
    then waited for the node that joined)."""
    import ray.train

    from bertpipe.jobs.pretrain.elastic import NodeProbe, WholeBatchScalingPolicy

    asked = []
    clock = {"now": 0.0}
    raylets = {"a": ("10.0.0.1", 1), "b": ("10.0.0.2", 1), "c": ("10.0.0.3", 1)}
    gone = {("10.0.0.3", 1)}
    probe = NodeProbe(addresses=lambda: raylets, answers=lambda at: asked.append(at) or at not in gone,
                      draining=set, clock=lambda: clock["now"], fresh_s=1.0)
    policy = WholeBatchScalingPolicy(ray.train.ScalingConfig(num_workers=(2, 3), resources_per_worker={"CPU": 1}),
                                     worlds=[2, 3], probe=probe)
    reserved = {node: {"CPU": 1.0} for node in raylets}
    assert policy._count_possible_workers(reserved) == 2  # a running group's resize check
    policy._starting = True
    assert policy._count_possible_workers(reserved) == 2
    assert len(asked) == 3  # asked once within a second
    clock["now"] += 1.0
    gone.clear()  # a node with that address joined again
    assert policy._count_possible_workers(reserved) == 3 and len(asked) == 6


def running_group(*nodes: str, num_workers: int | None = None):
    """Ray Train's WorkerGroupState as the policy reads it: when it started, how many workers, on which nodes."""
    from types import SimpleNamespace

    workers = [SimpleNamespace(metadata=SimpleNamespace(node_id=n)) for n in nodes]
    return SimpleNamespace(start_time=float("-inf"), num_workers=num_workers or len(nodes), workers=workers)


def resize_check(policy, group, *steps: int | None):
    """One resize check of a running group whose workers reported `steps` (None: no report this poll)."""
    from ray.train.v2._internal.execution.training_report import _TrainingReport
    from ray.train.v2._internal.execution.worker_group import WorkerGroupPollStatus, WorkerStatus

    policy._latest_monitor_time = float("-inf")  # each call a resize check (Ray spaces them out in time)
    status = WorkerGroupPollStatus({rank: WorkerStatus(running=True, training_report=None if step is None else
                                                       _TrainingReport(None, {"step": step, "loss": 2.0}, False))
                                    for rank, step in enumerate(steps)})
    return policy.make_decision_for_running_worker_group(group, status)


def test_a_restart_leaves_out_a_node_being_drained_and_a_running_group_waits_for_the_drains_deadline():
    """Ray Train restarts the group at a drain's deadline, while the drained node is alive, answers and is counted:
    sized by it, the new group would wait for a placement Ray never makes there until the start times out. A
    running group is not shrunk at the drain's notice: it trains on to the drain's checkpoint."""
    import ray.train
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision

    from bertpipe.jobs.pretrain.elastic import NodeProbe, WholeBatchScalingPolicy

    draining: set[str] = set()
    clock = {"now": 0.0}
    probe = NodeProbe(addresses=lambda: {n: ("10.0.0.1", i) for i, n in enumerate("ab")}, answers=lambda at: True,
                      draining=lambda: set(draining), clock=lambda: clock["now"])
    policy = WholeBatchScalingPolicy(ray.train.ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1}),
                                     worlds=[1, 2], probe=probe)
    reserved = {node: {"CPU": 1.0} for node in "ab"}
    policy._maybe_send_resource_request = lambda: None  # (Ray's autoscaling coordinator: not what is under test)
    policy._get_reserved_resources = lambda: reserved
    policy._starting = True
    assert policy._count_possible_workers(reserved) == 2
    draining.add("b")
    clock["now"] += 1.0
    assert policy._count_possible_workers(reserved) == 1
    policy._starting = False
    assert isinstance(resize_check(policy, running_group("a", "b"), None, None), NoopDecision)


def test_a_running_group_is_never_shrunk_by_a_resize_check():
    """Fewer nodes in the coordinator's view for a moment (a node's room taken by other work, a node not answering)
    must not restart a group that trains: a lost node fails its worker, and that restarts the group."""
    import ray.train
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision

    from bertpipe.jobs.pretrain.elastic import NodeProbe, WholeBatchScalingPolicy

    policy = WholeBatchScalingPolicy(ray.train.ScalingConfig(num_workers=(1, 3), resources_per_worker={"CPU": 1}),
                                     worlds=[1, 2, 3], probe=NodeProbe(addresses=dict))
    policy._maybe_send_resource_request = lambda: None
    room = {"a": {"CPU": 1.0}}
    policy._get_reserved_resources = lambda: dict(room)
    assert isinstance(resize_check(policy, running_group("a", "b")), NoopDecision)
    room.update(b={"CPU": 1.0}, c={"CPU": 1.0})
    decision = resize_check(policy, running_group("a", "b"))
    assert isinstance(decision, ResizeDecision) and decision.num_workers == 3


def test_a_grow_waits_for_a_joining_nodes_warm_process_and_looks_again_as_soon_as_it_is_up():
    """A grow restarts every worker: the joining node's worker, cold, would hold the whole group back (the rig's
    grow: worker start 14-16 s against 3-5 s forked). The policy warms the node first, grows at once when that is
    done, and counts a node whose warm-up outlasts its timeout all the same."""
    import ray.train
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision
    from ray.train.v2._internal.util import time_monotonic

    from bertpipe.jobs.pretrain.elastic import NodeProbe, WholeBatchScalingPolicy
    from bertpipe.jobs.pretrain.warm_start.node_warm_up import NodeWarmUp

    started, finished, clock = [], set(), {"now": 0.0}
    warm_up = NodeWarmUp({"py_executable": "launcher"}, timeout_s=60.0,
                         start=lambda node, env: started.append((node, env["py_executable"])) or node,
                         done=lambda node: node in finished, clock=lambda: clock["now"])
    policy = WholeBatchScalingPolicy(ray.train.ScalingConfig(num_workers=(2, 4), resources_per_worker={"CPU": 1}),
                                     worlds=[2, 3, 4], probe=NodeProbe(addresses=dict), warm_up=warm_up)
    policy._maybe_send_resource_request = lambda: None
    room = {node: {"CPU": 1.0} for node in "abc"}
    policy._get_reserved_resources = lambda: dict(room)
    group = running_group("a", "b")
    assert isinstance(resize_check(policy, group), NoopDecision)  # c joined: warming, not counted
    assert isinstance(resize_check(policy, group), NoopDecision)
    assert started == [("c", "launcher")]  # one warm-up, with the workers' own launcher
    policy._latest_monitor_time = time_monotonic()  # a resize check just happened: the next one is an interval away
    assert isinstance(policy.make_decision_for_running_worker_group(group, resize_check_status()), NoopDecision)
    finished.add("c")
    decision = policy.make_decision_for_running_worker_group(group, resize_check_status())
    assert isinstance(decision, ResizeDecision) and decision.num_workers == 3  # yet the warmed node is used now
    room["d"] = {"CPU": 1.0}  # a node whose warm-up never ends
    group = running_group("a", "b", "c")
    assert isinstance(resize_check(policy, group), NoopDecision)
    clock["now"] += 61.0
    decision = resize_check(policy, group)
    assert isinstance(decision, ResizeDecision) and decision.num_workers == 4
    assert [node for node, _ in started] == ["c", "d"]


def resize_check_status():
    from ray.train.v2._internal.execution.worker_group import WorkerGroupPollStatus

    return WorkerGroupPollStatus({})


def test_workers_that_start_as_fresh_processes_need_no_warm_up():
    from bertpipe.jobs.pretrain.warm_start.node_warm_up import NodeWarmUp

    started = []
    warm_up = NodeWarmUp({}, start=lambda node, env: started.append(node))
    assert warm_up.not_ready({"a", "b"}) == set() and started == []


# In a process of its own: the tests of a pytest worker share its Ray, which this one's cluster must not replace.
DRAINED_LISTED = """
import time
import ray
from ray.cluster_utils import Cluster
from ray.core.generated import autoscaler_pb2
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from bertpipe.jobs.pretrain.elastic import draining_nodes

@ray.remote(num_cpus=1)
class Holder:
    def ready(self):
        return True

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
try:
    node = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    busy = Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote()
    ray.get(busy.ready.remote())  # an idle node would be let go at once
    print("before", sorted(draining_nodes()))
    accepted, why = ray._raylet.GcsClient(address=cluster.address).drain_node(
        node.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), "test",
        int((time.time() + 60) * 1000))
    assert accepted, why
    print("after", sorted(draining_nodes()), node.node_id)
finally:
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.mark.integration
def test_the_cluster_tells_which_nodes_are_being_drained(tmp_path):
    """The real Ray call behind NodeProbe's default: a drained node that holds work is listed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, "-c", DRAINED_LISTED], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: line for line in out.stdout.splitlines()}
    assert lines["before"] == "before []", out.stdout
    node = lines["after"].split()[-1]
    assert lines["after"] == f"after ['{node}'] {node}", out.stdout


def test_a_running_group_grows_while_it_trains_and_not_once_a_worker_reported_the_last_step():
    """A node that joins while the workers evaluate, export and save the last checkpoint (the bench's back-after-30
    run: "the cluster grew at step 1500: going on with 3 workers from the step-1500 checkpoint") would restart the
    group to do all of that again."""
    import ray.train
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision

    from bertpipe.jobs.pretrain.elastic import NodeProbe, WholeBatchScalingPolicy

    policy = WholeBatchScalingPolicy(ray.train.ScalingConfig(num_workers=(2, 3), resources_per_worker={"CPU": 1}),
                                     worlds=[2, 3], last_step=30, probe=NodeProbe(addresses=dict))
    policy._maybe_send_resource_request = lambda: None  # (Ray's autoscaling coordinator: not what is under test)
    policy._get_reserved_resources = lambda: {node: {"CPU": 1.0} for node in "abc"}  # room for a third worker
    group = running_group("a", "b")

    assert isinstance(resize_check(policy, group, None, None), ResizeDecision)
    assert resize_check(policy, group, None, None).num_workers == 3
    assert isinstance(resize_check(policy, group, 20, 20), ResizeDecision)
    assert isinstance(resize_check(policy, group, 30, 30), NoopDecision)  # the last step reported: finishing
    assert isinstance(resize_check(policy, group, None, None), NoopDecision)  # and stays so between reports


def test_a_raylet_answers_when_its_port_listens_and_not_once_it_is_closed():
    import socket

    from bertpipe.jobs.pretrain.elastic import raylet_answers

    server = socket.create_server(("127.0.0.1", 0))
    address = server.getsockname()
    assert raylet_answers(address)
    server.close()
    assert not raylet_answers(address)  # refused: what a killed raylet's port answers
