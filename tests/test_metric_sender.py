"""A training worker's metrics never wait for the tracking server (jobs/services/metric_sender.py, sent through
jobs/services/tracking.py), tested against a real `mlflow server` on 127.0.0.1 (SQLite backend) that the tests
freeze (SIGSTOP), kill and start again on the same port, and against a port where nothing listens.

How a ten-minute outage is covered without waiting ten minutes: the sender's clock is injectable. The long-outage
test gives it a clock that moves only when the test says (one second per training step), while the server is really
down: every delivery attempt is a real refused connection, only the backoff's waiting is simulated. The
frozen-server test runs on the real clock: a request in flight that gets no answer, and logging goes on meanwhile.
"""
from __future__ import annotations

import logging
import signal
import threading
import time

import pytest
from mlflow import MlflowClient

from bertpipe.jobs.services.tracking import RunLogger, metric_sender, start_workflow_run
from mlflow_rig import MlflowServer, quiet_env
from ports import closed_port_uri
from waiting import wait_until

KEYS = ("train/loss", "train/optimizer/lr")


class FakeClock:
    """The sender's clock, moved by the test: `sleep` returns once the test has advanced time past its end."""

    def __init__(self) -> None:
        self.t = 0.0
        self.cond = threading.Condition()
        self.naps: list[float] = []  # every backoff asked for, in order
        self.asleep_until: dict[int, float] = {}  # thread id -> the time it wakes at

    def now(self) -> float:
        with self.cond:
            return self.t

    def sleep(self, seconds: float, interrupt: threading.Event) -> None:
        me = threading.get_ident()
        with self.cond:
            self.naps.append(seconds)
            self.asleep_until[me] = self.t + seconds
            while self.t < self.asleep_until[me] and not interrupt.is_set():
                self.cond.wait(0.1)  # advance() wakes it; the timeout only notices `interrupt`
            del self.asleep_until[me]

    def advance(self, seconds: float) -> None:
        with self.cond:
            self.t += seconds
            self.cond.notify_all()

    def settled(self, sender) -> bool:
        """The sender has done what this moment asks: asleep until a later time, or idle with nothing to send."""
        with self.cond:
            wake = self.asleep_until.get(sender.thread_id)
            if wake is not None and wake > self.t:
                return True
        return sender.pending() == 0 and not sender.sending


def points(step: int) -> list[tuple]:
    return [(key, float(step) / (i + 1), 1_700_000_000_000 + step, step) for i, key in enumerate(KEYS)]


def steps_in_store(client, run_id: str, key: str = KEYS[0]) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


@pytest.fixture
def library_records():
    """Every record of urllib3's and MLflow's loggers that reaches a handler while the test runs."""
    caught: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record)

    handler, loggers = Catch(logging.DEBUG), [logging.getLogger(n) for n in ("urllib3", "mlflow")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
        lg.addHandler(handler)
    yield caught
    for lg, level in zip(loggers, levels):
        lg.removeHandler(handler)
        lg.setLevel(level)


# ------------------------------------------------------------------------------------------------------------------
# Without a server: the settings reach the sender, a local store, a port where nothing listens


def test_settings_travel_with_the_coordinates_to_a_background_logger(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    parent = start_workflow_run(uri, "e", "run", {"mlflow": {"buffer_points": 7, "flush_timeout_s": 3.0}}, {})
    assert parent.coordinates["buffer_points"] == "7" and parent.coordinates["flush_timeout_s"] == "3.0"
    stage = parent.child("pretrain", {})  # what the stage context hands the workers
    worker = RunLogger(stage.coordinates, background=True)
    assert worker.sender is not None and worker.sender.capacity == 7
    for step in range(1, 4):
        worker.log_metrics({"loss": 1.0 / step, "lr": 1e-3}, step)
    assert worker.flush_metrics() == 0
    assert worker.sender is None  # closed: later calls log directly
    worker.log_metrics({"loss": 0.1}, 4)
    assert steps_in_store(worker.client, worker.run_id, "loss") == [1, 2, 3, 4]
    # Rank > 0 and tracking off have no sender and nothing to flush.
    assert RunLogger(stage.coordinates, enabled=False, background=True).sender is None
    assert RunLogger(None, background=True).flush_metrics() == 0


def test_a_full_buffer_keeps_the_newest_points_and_the_end_counts_what_was_lost(library_records):
    """Nothing listens at the URI: the points wait, the oldest are dropped past the buffer's size, and the end
    (its flush timeout on the sender's clock) says how many never arrived."""
    clock, lines = FakeClock(), []
    coordinates = {"tracking_uri": closed_port_uri(), "run_id": "0" * 32, "buffer_points": "10"}
    sender = metric_sender(MlflowClient(coordinates["tracking_uri"]), coordinates, lines.append, clock=clock)
    for step in range(1, 9):  # 16 points into a buffer of 10
        clock.advance(1.0)
        sender.put(points(step))
        wait_until(lambda: clock.settled(sender), "the sender to settle", 60, poll_s=0.005)
    assert sender.pending() == 10 and sender.dropped == 6
    unreachable = [x for x in lines if "is unreachable" in x]
    assert len(unreachable) == 1 and "(Connection refused)" in unreachable[0], lines
    assert len([x for x in lines if "buffer is full" in x]) == 1, lines
    assert sender.attempts >= 4 and clock.naps[:3] == [1.0, 2.0, 4.0]

    done: list[int] = []
    closer = threading.Thread(target=lambda: done.append(sender.close(30.0)))
    closer.start()
    while closer.is_alive():  # the end's 30 s pass on the sender's clock
        clock.advance(1.0)
        closer.join(0.05)
    assert done == [16]
    assert lines[-1].endswith("16 metric points of this run were not delivered to the tracking server "
                              f"{coordinates['tracking_uri']}: 10 still waiting after 30 s (setting "
                              "mlflow.flush_timeout_s), 6 dropped from the full buffer")
    assert not [r for r in library_records if r.thread == sender.thread_id], library_records


# ------------------------------------------------------------------------------------------------------------------
# A real server that goes away and comes back


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-outage")
    srv = MlflowServer(["--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                        "--artifacts-destination", str(root / "artifacts")],
                       quiet_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"), root / "server.log")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def up(server):
    """The server, running (a test that failed while it was stopped leaves it stopped)."""
    if server.proc is None:
        server.start()
    return server


def new_run(server, **settings: str) -> dict[str, str]:
    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("outage") or client.get_experiment(client.create_experiment("outage"))
    run = client.create_run(experiment.experiment_id)
    return {"tracking_uri": server.uri, "experiment_id": experiment.experiment_id, "run_id": run.info.run_id,
            **settings}


def record_order(sender) -> list[int]:
    """The steps of the points the server took, in the order it took them (the real delivery, observed)."""
    order: list[int] = []
    deliver = sender.deliver

    def observed(batch: list) -> None:
        deliver(batch)
        order.extend(p[3] for p in batch if p[0] == KEYS[0])

    sender.deliver = observed
    return order


@pytest.mark.integration
def test_logging_goes_on_while_the_server_hangs_or_is_gone(up, library_records):
    server = up
    lines: list[str] = []
    coordinates = new_run(server)
    client = MlflowClient(server.uri)
    sender = metric_sender(client, coordinates, lines.append, backoff_s=(0.2, 1.0))
    order = record_order(sender)
    sender.put(points(1))
    wait_until(lambda: sender.delivered == 2, "the first points delivered", 120)

    # A frozen server takes the connection and never answers: the thread waits inside its request, and logging
    # calls made meanwhile return (the test goes on past them while that same attempt is still in flight).
    server.signal(signal.SIGSTOP)
    try:
        sender.put(points(2))
        wait_until(lambda: sender.sending and sender.attempts == 2, "a request to the frozen server", 60)
        for step in range(3, 11):
            sender.put(points(step))
        assert sender.sending and sender.attempts == 2 and sender.pending() == 18
    finally:
        server.signal(signal.SIGCONT)
    wait_until(lambda: sender.pending() == 0, "the points logged while frozen delivered", 120)
    assert not [x for x in lines if "unreachable" in x], lines  # slow, not away: it answered within its timeout

    # Gone: refused connections. Steps go on; one line says the server is unreachable.
    server.stop()
    step, tries = 10, sender.attempts
    while sender.attempts < tries + 4:  # a few failed tries, with the backoff between them
        step += 1
        sender.put(points(step))
        time.sleep(0.05)  # a training step
    assert sender.down_since is not None and sender.delivered == 20
    server.start()
    wait_until(lambda: sender.pending() == 0, "the points of the outage delivered", 120)
    assert sender.close(10.0) == 0

    unreachable = [x for x in lines if "is unreachable" in x]
    back = [x for x in lines if " is back after " in x]
    assert len(unreachable) == 1 and "Connection refused" in unreachable[0] and len(back) == 1, lines
    assert f"sending the {2 * (step - 10)} metric points kept meanwhile" in back[0], back
    assert steps_in_store(client, coordinates["run_id"]) == list(range(1, step + 1))
    assert steps_in_store(client, coordinates["run_id"], KEYS[1]) == list(range(1, step + 1))
    assert order == list(range(1, step + 1))  # delivered in the order logged
    assert not [r for r in library_records if r.levelno >= logging.WARNING], library_records


@pytest.mark.integration
def test_a_ten_minute_outage_on_a_fake_clock(up):
    """600 steps, one a second on the sender's clock, against a server that is really down: the thread retries at
    1, 2, 4, 8 s, then every 15 s to the end; every point waits and arrives once the server is back. A second run's
    sender, with a buffer of 100 points, keeps the newest 100."""
    server = up
    clock, small_clock, lines, small_lines = FakeClock(), FakeClock(), [], []
    client = MlflowClient(server.uri)
    big_run, small_run = new_run(server), new_run(server, buffer_points="100")
    big = metric_sender(client, big_run, lines.append, clock=clock)
    small = metric_sender(client, small_run, small_lines.append, clock=small_clock)
    order = record_order(big)
    for sender in (big, small):
        sender.put(points(0))
    wait_until(lambda: big.delivered == small.delivered == 2, "the first points delivered", 120)
    tries_before = big.attempts

    server.stop()
    for step in range(1, 601):
        for sender, its_clock in ((big, clock), (small, small_clock)):
            its_clock.advance(1.0)
            sender.put(points(step))  # returns at once: the test goes on while the sender sleeps or fails
        wait_until(lambda: clock.settled(big) and small_clock.settled(small), f"the senders to settle at step {step}",
                   60, poll_s=0.005)
    assert big.pending() == 1200 and big.dropped == 0
    assert small.pending() == 100 and small.dropped == 1100
    assert clock.naps[:6] == [1.0, 2.0, 4.0, 8.0, 15.0, 15.0] and max(clock.naps) == 15.0
    # Tries at 1, 2, 4, 8, 16 s, then every 15 s to 600: never given up.
    assert big.attempts - tries_before == 5 + (600 - 16) // 15
    assert len([x for x in lines if "is unreachable" in x]) == 1 and not [x for x in lines if " is back after " in x]

    server.start()  # the clocks stand still meanwhile
    clock.advance(15.0)
    small_clock.advance(15.0)
    wait_until(lambda: big.pending() == 0 and small.pending() == 0, "the outage's points delivered", 120)
    back = [x for x in lines if " is back after " in x]
    assert len(back) == 1 and "is back after 0:10:" in back[0] and "sending the 1,200 metric points" in back[0]
    assert steps_in_store(client, big_run["run_id"]) == list(range(0, 601))
    assert order == list(range(0, 601))
    assert steps_in_store(client, small_run["run_id"]) == [0, *range(551, 601)]
    assert len([x for x in small_lines if "buffer is full" in x]) == 1
    assert "1,100 points dropped so far (full buffer)" in [x for x in small_lines if " is back after " in x][0]
    for sender in (big, small):
        sender.close(0.0)


@pytest.mark.integration
def test_a_batch_the_server_refuses_is_dropped_and_later_ones_still_go(up):
    server = up
    lines: list[str] = []
    client = MlflowClient(server.uri)
    coordinates = new_run(server)
    sender = metric_sender(client, coordinates, lines.append)
    sender.put([("", 1.0, 0, 1)])  # a metric without a name: the server answers 400 INVALID_PARAMETER_VALUE
    wait_until(lambda: sender.refused == 1, "the bad batch refused", 120)
    sender.put(points(2))
    wait_until(lambda: sender.delivered == 2, "the next batch delivered", 120)
    assert sender.attempts == 2 and sender.close(0.0) == 1
    assert len([x for x in lines if "refused a batch of 1 metric points" in x]) == 1, lines
    assert not [x for x in lines if "unreachable" in x]
    assert steps_in_store(client, coordinates["run_id"]) == [2]


def test_system_metrics_are_sampled_into_the_run_through_a_sender(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run = start_workflow_run(uri, "e", "run", {}, {})
    monitor = run.system_metrics(interval_s=0.2)
    wait_until(lambda: len(run.client.get_metric_history(run.run_id, "system/cpu_utilization_percentage")) >= 2,
               "two samples of the CPU's use", 120)
    assert monitor.finish() == 0
    samples = run.client.get_metric_history(run.run_id, "system/cpu_utilization_percentage")
    assert sorted(m.step for m in samples)[:2] == [0, 1]
    assert "system/system_memory_usage_megabytes" in run.client.get_run(run.run_id).data.metrics
