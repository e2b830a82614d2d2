"""The pieces behind "no silent minute": the pre-training ETA's arithmetic (jobs/pretrain/metrics/eta.py) and the
console's heartbeat (pipeline/framework/console.py). The whole, on a real run, is tests/test_first_hour.py."""
from __future__ import annotations

import sys

import pytest

from bertpipe.jobs.config import load_config
from bertpipe.jobs.pretrain.metrics import eta
from bertpipe.pipeline.framework import progress
from bertpipe.pipeline.framework.console import QUIET_S, Console


@pytest.fixture
def tiny():
    cfg = load_config("tiny", [], None)  # 36 steps at seq 128, 4 at seq 512; evaluation and checkpoint at 20
    schedule = eta.Schedule(cfg.pretrain, cfg.model, 8192, 2, {0: 5698, 1: 1818}, {0: 144, 1: 45})
    measured = eta.Measurements()
    for _ in range(10):
        measured.step(0, 0.2)
    return cfg, schedule, measured


def test_nothing_measured_no_eta(tiny):
    cfg, schedule, _ = tiny
    assert eta.seconds_left(schedule, eta.Measurements(), 0, 0) is None


def test_the_phase_switch_is_priced_by_its_compute(tiny):
    cfg, schedule, measured = tiny
    ratio = eta.step_cost(cfg.model, 8192, cfg.pretrain.phases[1]) / eta.step_cost(cfg.model, 8192,
                                                                                   cfg.pretrain.phases[0])
    assert ratio > 1.2  # seq 512: attention and the MLM head grow faster than the tokens per step
    # From the last step of phase 1: phase 2's 4 steps at the scaled step time, then the end.
    end = eta.seconds_left(schedule, measured, 40, 1)
    assert eta.seconds_left(schedule, measured, 36, 0) - end == pytest.approx(4 * 0.2 * ratio)


def test_slow_first_steps_do_not_price_the_rest(tiny):
    """The first steps of a phase (warm-up) are slow: a typical step is the median of the recent ones, and a phase
    with fewer than STEADY_STEPS steps is priced from the steady phase before it, not by its first step."""
    cfg, schedule, measured = tiny
    steady = eta.seconds_left(schedule, measured, 20, 0)
    measured.step_s[0] = [1.0, 0.8] + measured.step_s[0]  # two warm-up steps before the ten steady ones
    assert eta.seconds_left(schedule, measured, 20, 0) == pytest.approx(steady)
    switch = eta.seconds_left(schedule, measured, 37, 1)
    measured.step(1, 3.0)  # the first step at seq 512, slow
    assert eta.seconds_left(schedule, measured, 37, 1) == pytest.approx(switch)
    for _ in range(eta.STEADY_STEPS - 1):
        measured.step(1, 3.0)  # a steady phase 2 at 3 s a step prices its own remaining steps
    assert eta.seconds_left(schedule, measured, 37, 1) > switch + 3 * 2.0


def test_evaluations_and_checkpoints_count_once_measured(tiny):
    cfg, schedule, measured = tiny
    before = eta.seconds_left(schedule, measured, 19, 0) - eta.seconds_left(schedule, measured, 21, 0)
    measured.eval_s[0], measured.checkpoint_s = 7.0, 3.0
    after = eta.seconds_left(schedule, measured, 19, 0) - eta.seconds_left(schedule, measured, 21, 0)
    assert after - before == pytest.approx(7.0 + 3.0 - (before - 2 * 0.2), rel=1e-6)
    # the end always holds the final evaluation, the export and the last checkpoint
    assert eta.seconds_left(schedule, measured, 40, 1) > 3.0


def test_a_timed_held_out_batch_prices_each_evaluation_until_one_ran(tiny):
    """On a CPU the workers time one held-out batch of each phase before the first step (evaluation.time_eval_batches):
    every evaluation not yet measured costs its batches at that time; a measured one costs what it took."""
    cfg, schedule, measured = tiny
    rule = eta.seconds_left(schedule, measured, 19, 0)
    measured.eval_batch_s.update({0: 0.25, 1: 0.5})
    timed = eta.seconds_left(schedule, measured, 19, 0)
    measured.eval_batch_s.update({0: 0.5, 1: 1.0})
    doubled = eta.seconds_left(schedule, measured, 19, 0)
    # the evaluation at step 20 (phase 1's length) and the final one (phase 2's)
    assert doubled - timed == pytest.approx(schedule.eval_batches(0) * 0.25 + schedule.eval_batches(1) * 0.5)
    assert timed != pytest.approx(rule)
    measured.eval_s[0] = 2.0  # the evaluation at step 20 ran: its phase's timed batch no longer counts
    priced = eta.seconds_left(schedule, measured, 19, 0)
    measured.eval_batch_s[0] = 9.0
    assert eta.seconds_left(schedule, measured, 19, 0) == pytest.approx(priced)


def test_epoch_boundaries_open_streams_but_not_a_phase_first(tiny):
    cfg, _, measured = tiny
    measured.stream_start_s = 5.0
    # 12 steps per epoch of phase 1 (200 rows per worker / micro-batch 16): 36 steps = 3 streams, the first opened
    # before training; phase 2 within one epoch.
    small = eta.Schedule(cfg.pretrain, cfg.model, 8192, 2, {0: 200, 1: 1818}, {0: 144, 1: 45})
    big = eta.Schedule(cfg.pretrain, cfg.model, 8192, 2, {0: 5698, 1: 1818}, {0: 144, 1: 45})
    assert eta.seconds_left(small, measured, 1, 0) - eta.seconds_left(big, measured, 1, 0) == pytest.approx(2 * 5.0)
    # after step 24 the third epoch's stream is still to open (with step 25), after step 25 it is open
    assert eta.seconds_left(small, measured, 24, 0) - eta.seconds_left(big, measured, 24, 0) == pytest.approx(5.0)
    assert eta.seconds_left(small, measured, 25, 0) == pytest.approx(eta.seconds_left(big, measured, 25, 0))


def test_a_million_steps_cost_no_time_to_estimate():
    cfg = load_config("bert_large", [], None)
    schedule = eta.Schedule(cfg.pretrain, cfg.model, 30522, 2, {}, {})
    measured = eta.Measurements()
    measured.step(0, 1.0)
    lines = [0]

    def count(frame, event, arg):  # every Python line run, in eta.py and whatever it calls
        if event == "line":
            lines[0] += 1
        return count

    sys.settrace(count)
    try:
        for step in (1, 500_000, 999_999):
            eta.seconds_left(schedule, measured, step, 0)
    finally:
        sys.settrace(None)
    assert lines[0] < 3 * 2000  # a loop over the million steps would run millions of lines


def test_progress_prefers_the_work_s_own_estimate(monkeypatch):
    """The workers' estimate, made 5 s ago, less those 5 s; nothing is added for what no one measured."""
    monkeypatch.setattr(progress.time, "time", lambda: 1_000.0)  # the wall clock the workers stamp `eta_at` with
    shown = Console().progress("pretrain", 40, "steps")
    shown.set(10, eta_s=20.0, eta_at=995.0)
    assert shown.eta() == 15.0
    assert "ETA 0:00:1" in shown.line()


class FakeTime:
    """A perf_counter the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def training_metrics(tiny):
    """The tiny preset's worker metrics (rank 0, 2 workers, the rows of `tiny`) on a fake clock; its reports kept."""
    from bertpipe.jobs.pretrain.metrics.training_metrics import TrainingMetrics
    from bertpipe.jobs.pretrain.worker_spec import WorkerSpec
    from bertpipe.jobs.services.tracking import RunLogger

    cfg, _, _ = tiny
    reports = []

    class Board:
        def set(self, count, **fields):
            reports.append((count, fields))

    spec = WorkerSpec(pretrain=cfg.pretrain, model=cfg.model, seed=1, vocab_tokens=["w"] * 8192, vocab_bytes=b"",
                      tracking={}, export_uri="", storage_path="", run_name="r", progress=Board(),
                      rows={"train_128": 2 * 5698, "train_512": 2 * 1818, "heldout_128": 288, "heldout_512": 90})
    now = FakeTime()
    return TrainingMetrics(spec, 0, 2, "cpu", RunLogger({}, enabled=False), now=now), now, reports


def test_the_metrics_leave_set_aside_time_out_of_the_step_and_price_it(training_metrics):
    """The loop's marks on a fake clock: steps of 0.2 s; an evaluation (3 s), a checkpoint (1 s), a compile (9 s)
    and a stream opened between two steps (2 s) stay out of the step time; the evaluation and the checkpoint price
    the next ones, the stream the next epochs'; every step's report carries the ETA of what was measured."""
    metrics, now, reports = training_metrics
    metrics.start_phase(0)
    for step in range(1, 11):
        now.now += 0.2
        if step == 2:
            with metrics.aside("compile"):
                now.now += 9.0
        if step == 5:
            with metrics.aside("evaluation", 0) as took:
                now.now += 3.0
            with metrics.aside("checkpoint"):
                now.now += 1.0
        if step == 7:
            metrics.stream_opened(2.0, before_training=False)
            now.now += 2.0
        metrics.optimizer_step(step, 0, None)
    assert metrics.measured.step_s[0] == pytest.approx([0.2] * 10)
    assert took.seconds == pytest.approx(3.0)
    assert (metrics.measured.eval_s, metrics.measured.checkpoint_s, metrics.measured.stream_start_s) == \
        (pytest.approx({0: 3.0}), pytest.approx(1.0), 2.0)
    assert metrics.meter.paused == pytest.approx(4.0)  # the evaluation and the checkpoint leave the throughput
    assert [count for count, _ in reports] == list(range(1, 11))
    count, fields = reports[-1]
    assert fields["eta_s"] == pytest.approx(eta.seconds_left(metrics.schedule, metrics.measured, 10, 0))
    assert fields["eta_s"] > 30 * 0.2 + 3.0 + 1.0  # phase 1's 26 steps left, its evaluation and checkpoint at 20


def test_streams_opened_before_training_count_by_the_slowest(training_metrics):
    metrics, now, _ = training_metrics
    for seconds in (1.5, 4.0, 2.5):  # opened at once, in threads
        metrics.stream_opened(seconds, before_training=True)
    metrics.start_phase(0)
    now.now += 0.2
    metrics.optimizer_step(1, 0, None)
    assert metrics.measured.stream_start_s == 4.0 and metrics.measured.step_s[0] == pytest.approx([0.2])


def test_a_quiet_console_hears_what_runs(capsys):
    """The heartbeat names the innermost activity once the console has been quiet for QUIET_S, and no sooner (a fake
    clock: the watchdog thread's heartbeats see the same time as the test's)."""
    now = [1000.0]
    console = Console(live=True, clock=lambda: now[0])
    try:
        with console.doing("pretrain: running"):
            with console.doing("registering the model in MLflow"):
                now[0] += QUIET_S - 0.1
                console.heartbeat()
                assert capsys.readouterr().out == ""
                now[0] += 0.1
                console.heartbeat()
                console.heartbeat()  # just printed: quiet again only QUIET_S later
        now[0] += QUIET_S
        console.heartbeat()  # nothing runs: nothing to say
    finally:
        console.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("  registering the model in MLflow · 0:00:00"), lines
