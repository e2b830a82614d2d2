"""benchmarks/bench_chaos.py's reading of a run (no Ray): the run log's progress and resize lines, each restart's
latency split into its parts, the loss curves' largest difference, the table."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location("bench_chaos",
                                               Path(__file__).resolve().parents[1] / "benchmarks" / "bench_chaos.py")
bc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bc)

T0 = time.mktime(time.strptime("2026-11-27 17:00:00", "%Y-%m-%d %H:%M:%S"))


def at(seconds: float, text: str) -> str:
    whole = int(seconds)
    clock = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(T0 + whole))
    return f"{clock},{round((seconds - whole) * 1000):03d} INFO {text}"


def progress(seconds: float, step: int) -> str:
    return at(seconds, f"bertpipe.progress: pretrain: {step}/100 ({step}%) steps · loss 7.1 · ETA 1m")


LOG = [progress(1, 1), progress(2, 10), progress(3, 22), progress(4, 25),
       # a node killed at 4.5 s (step 25), declared dead at 19.5 s
       at(19.6, "bertpipe.pretrain: pretrain: a worker node (192.0.2.2, 1 CPUs) was lost at step 25; Ray Train "
                "restarts the workers from the last checkpoint"),
       at(30.0, "bertpipe.pretrain: pretrain: a worker node (192.0.2.2, 1 CPUs) was lost at step 25: going on with "
                "2 workers from the step-20 checkpoint, accumulation 2 → 3"),
       progress(31, 21), progress(33, 25), progress(34, 26), progress(40, 40),
       # a node joined at 36 s; the grow's new attempt started at 45 s from the step-40 checkpoint
       at(46.0, "bertpipe.pretrain: pretrain: the cluster grew at step 41: going on with 3 workers from the step-40 "
                "checkpoint, accumulation 3 → 2"),
       progress(47, 42), progress(60, 100)]
EVENTS = [{"kind": "kill", "at": T0 + 4.5, "detected_at": T0 + 19.5, "node": "a"},
          {"kind": "join", "at": T0 + 36, "node": "b"}]


def test_the_resize_lines_are_read_with_their_times_and_steps():
    found = bc.resize_lines(LOG)
    assert [(r["kind"], r["reached"], r["resumed"], r["workers"], r["accumulation"]) for r in found] == [
        ("lost", 25, 20, 2, [2, 3]), ("grew", 41, 40, 3, [3, 2])]
    assert found[0]["at"] == T0 + 30 and found[0]["line"].startswith("pretrain: a worker node")


def test_a_restart_of_the_same_size_is_read_too():
    line = at(5, "bertpipe.pretrain: pretrain: the workers failed at step 31; restarted from the step-30 "
                 "checkpoint, attempt 2 of 4")
    assert [(r["kind"], r["reached"], r["resumed"], r["workers"]) for r in bc.resize_lines([line])] == [
        ("failed", 31, 30, None)]


def test_a_loss_is_split_into_detection_attempt_and_redo():
    points = bc.progress_points(LOG)
    lost, grew = bc.restarts(bc.resize_lines(LOG), EVENTS, points, {})
    assert round(lost["latency_s"], 3) == 34 - 4.5  # kill → step 26, the first past 25
    assert round(lost["detection_s"], 3) == 15
    assert round(lost["attempt_s"], 3) == 31 - 4.5  # → the new attempt's first step (21)
    assert round(lost["redo_s"], 3) == 3  # steps 21-25 again
    assert lost["redone_steps"] == 5
    assert round(grew["latency_s"], 3) == 47 - 36  # the join → step 42
    assert round(grew["stall_s"], 3) == 47 - 40  # step 40 (the last before) shown at 40 s
    assert round(grew["attempt_s"], 3) == 47 - 36 and grew["redo_s"] == 0  # step 41 never shown: nothing to redo


def test_a_redo_shorter_than_a_poll_is_no_redo():
    log = [progress(1, 1), progress(4, 25), progress(30, 27),
           at(29.0, "bertpipe.pretrain: pretrain: a worker node (192.0.2.2, 1 CPUs) was lost at step 25; "
                    "restarted from the step-24 checkpoint, attempt 2 of 4")]
    (lost,) = bc.restarts(bc.resize_lines(log), EVENTS[:1], bc.progress_points(log), {})
    assert (round(lost["attempt_s"], 3), lost["redo_s"], lost["redone_steps"]) == (25.5, 0, 1)


def test_a_restart_done_before_the_node_is_declared_dead_is_timed_from_its_own_first_step():
    """The warm restarts of the back-after-30 run reached their first new step 7 s after the kill, the cluster
    declared the node dead at 13 s: the attempt's first step is the first shown below the step reached."""
    log = [progress(1, 1), progress(4, 25), progress(6, 21), progress(7, 26), progress(19, 60),
           at(8.0, "bertpipe.pretrain: pretrain: a worker node (192.0.2.2, 1 CPUs) was lost at step 25: going on "
                   "with 2 workers from the step-20 checkpoint, accumulation 2 → 3")]
    events = [{"kind": "kill", "at": T0 + 4.5, "detected_at": T0 + 17.5, "node": "a"}]
    (lost,) = bc.restarts(bc.resize_lines(log), events, bc.progress_points(log), {})
    assert (lost["latency_s"], lost["attempt_s"], lost["redo_s"]) == (2.5, 1.5, 1.0)


def test_a_later_restarts_step_back_is_not_this_ones_first_step():
    """The chaos bench of 2026-11-29: the polls missed the first loss's redo (steps 501-502 between two), and the
    first step back shown was the grow's, 45 s later: the attempt's first step shown is then its first new step."""
    log = [progress(1, 1), progress(4, 25), progress(16, 28), progress(40, 50), progress(46, 41), progress(47, 52),
           at(18.0, "bertpipe.pretrain: pretrain: a worker node (192.0.2.2, 1 CPUs) was lost at step 25: going on "
                    "with 2 workers from the step-24 checkpoint, accumulation 2 → 3")]
    events = [{"kind": "kill", "at": T0 + 4.5, "detected_at": T0 + 17.5, "node": "a"}]
    (lost,) = bc.restarts(bc.resize_lines(log), events, bc.progress_points(log), {})
    assert (lost["latency_s"], lost["attempt_s"], lost["redo_s"]) == (11.5, 11.5, 0.0)


def test_the_workers_restart_metrics_go_to_their_restart():
    parts = {"total_s": [(T0 + 31, 21, 8.0), (T0 + 47, 41, 5.0)], "compile_s": [(T0 + 31, 21, 0.5)]}
    lost, grew = bc.restarts(bc.resize_lines(LOG), EVENTS, bc.progress_points(LOG), parts)
    assert (lost["worker_total_s"], lost["worker_compile_s"]) == (8.0, 0.5)
    assert (grew["worker_total_s"], grew["worker_compile_s"]) == (5.0, None)
    rows = bc.restart_table({"restarts": [lost, grew]}).splitlines()
    # the group started 26.5 - 8 s after the kill; the attempt's first step 26.5 s after it
    assert rows[2] == ("| lost at step 25 → 2 workers from step 20 | 5 | 29.5 | 15.0 | 18.5 | 26.5 | – | – | – | 0.5 "
                       "| – | 3.0 |")


def test_a_step_logged_again_keeps_its_last_value_and_the_gap_is_at_equal_steps():
    curve = bc.last_per_step([(1.0, 2, 7.0), (2.0, 4, 6.0), (5.0, 2, 6.9), (6.0, 4, 6.2), (7.0, 6, 5.0)])
    assert curve == {2: 6.9, 4: 6.2, 6: 5.0}
    assert bc.largest_gap(curve, {2: 7.0, 4: 6.0, 8: 1.0}) == (4, curve[4] - 6.0)
    assert bc.largest_gap(curve, {9: 1.0}) is None


def test_the_training_span_leaves_the_start_up_out():
    assert bc.training_span(bc.progress_points(LOG), 100) == 59


def test_the_table_shows_a_dash_for_what_is_absent():
    run = {"wall_s": 100.0, "train_s": 80.0, "loss": {"2": 7.0, "4": 6.0}, "events": [], "restarts": [],
           "redone_steps": 0, "world_sizes": [3], "checkpoint_stall_s": [], "workers": "[1, 3]"}
    chaos = {**run, "train_s": 100.0, "loss": {"2": 7.0, "4": 6.5}, "events": EVENTS, "redone_steps": 5,
             "world_sizes": [3, 2, 3],
             "restarts": bc.restarts(bc.resize_lines(LOG), EVENTS, bc.progress_points(LOG), {})}
    table = bc.summary_table(run, chaos, None, "chaos")
    assert "| goodput (undisturbed training time / this one) | 100% | 80% |" in table
    assert "| largest loss difference at equal steps (vs undisturbed) | 0 | 0.500 (step 4) |" in table
    assert "| checkpoint stall, mean / max s (`checkpoint/stall_s`) | – | – |" in table
    rows = bc.restart_table(chaos).splitlines()
    assert rows[2] == ("| lost at step 25 → 2 workers from step 20 | 5 | 29.5 | 15.0 | – | 26.5 | – | – | – | – | – "
                       "| 3.0 |")
    assert rows[3].startswith("| grew at step 41 → 3 workers from step 40 | 1 | 11.0 (stall 7.0) | – | – | 11.0 |")
