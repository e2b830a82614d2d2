"""One run per workdir, with real processes: two `bertpipe run` CLIs on one workdir, a holder killed with -9, signals,
a record from another host, and an s3:// workdir on a local S3 server (moto's, a separate process speaking the S3
HTTP API, conditional writes included) reached through the same boto3 calls a real bucket gets.

The first run is held in place by an MLflow URI whose server accepts connections and never answers (a listening
socket nobody accepts on), and then frozen with SIGSTOP once its lock record names it: a stopped process keeps its
lock, so what the second run sees does not depend on how long the first takes to fail.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ports import closed_port_uri, free_port_block, silent_server
from terminal import as_in_a_terminal

BIN = Path(sys.executable).parent
HOST = socket.gethostname()
LOCK = ".bertpipe.lock"


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_", "AWS_"))}
    # A refused MLflow connection fails at once instead of after MLflow's retries with backoff.
    env.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="60", **extra)
    return env


def run_args(workdir: str, tracking: str) -> list[str]:
    # vocab from a small text file: preflight checks only that file, and nothing runs before MLflow answers.
    return [str(BIN / "bertpipe"), "run", "--workdir", workdir, "--only", "vocab", "--set", "vocab.input=corpus.txt",
            "--set", f"mlflow.tracking_uri={tracking}"]


@pytest.fixture
def rundir(tmp_path) -> Path:
    (tmp_path / "corpus.txt").write_text("One sentence here. Another one.\n\nA second document.\n")
    return tmp_path


def read_record(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def wait_for_holder(path: Path, pid: int, proc: subprocess.Popen, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = read_record(path)
        if record.get("pid") == pid:
            return record
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError(f"{path} never named pid {pid}")


def tree(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*"))}


def start_first_run(rundir: Path, workdir: str, tracking: str) -> tuple[subprocess.Popen, dict]:
    """A real `bertpipe run` that holds `workdir`, frozen (SIGSTOP) right after it took the lock."""
    proc = subprocess.Popen(as_in_a_terminal(run_args(workdir, tracking)), cwd=rundir, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    record = wait_for_holder(rundir / workdir / LOCK, proc.pid, proc)
    proc.send_signal(signal.SIGSTOP)
    return proc, record


def end_with(proc: subprocess.Popen, sig: int) -> tuple[int, str]:
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def test_second_run_is_refused_at_once_and_sigterm_releases(rundir):
    with silent_server() as tracking:
        first, record = start_first_run(rundir, "w", tracking)
        try:
            assert record["host"] == HOST and "bertpipe run --workdir w --only vocab" in record["command"]
            before = tree(rundir / "w")
            started = time.monotonic()
            second = subprocess.run(run_args("w", tracking), cwd=rundir, env=cli_env(), capture_output=True,
                                    text=True, timeout=120)
            took = time.monotonic() - started
            lines = second.stderr.strip().splitlines()
            assert second.returncode == 2 and len(lines) == 1, second.stderr
            line = lines[0]
            assert line.startswith("bertpipe: error: workdir ") and "in use by another run" in line
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["started"]))
            for needle in (f"host {HOST}", f"pid {first.pid}", f"started {when}", "command: bertpipe run --workdir w"):
                assert needle in line, line
            assert second.stdout == ""
            assert tree(rundir / "w") == before  # the refused run wrote nothing: no log file, no folder
            assert took < 30, took  # refused before preflight, MLflow or Ray (the CLI's import time only)
        finally:
            code, err = end_with(first, signal.SIGTERM)
    # SIGTERM ends the run through its `finally`s: status 143 and no lock left behind.
    assert code == 143, err
    assert not (rundir / "w" / LOCK).exists()


def test_sigint_releases_the_lock(rundir):
    with silent_server() as tracking:
        first, _ = start_first_run(rundir, "w", tracking)
        code, err = end_with(first, signal.SIGINT)
    # Stopped before it had a log file: one line, no traceback, 128 + SIGINT (jobs/services/interrupts.py).
    assert code == 130 and err.strip() == "bertpipe: interrupted by SIGINT", err
    assert not (rundir / "w" / LOCK).exists()


HOLDER = """
import sys, time
from bertpipe.pipeline.framework.workdir_lock import acquire
lock = acquire(sys.argv[1], command="holder --of the test", lease_s=float(sys.argv[2]))
print("held", flush=True)
sys.stdin.read()  # until the test closes stdin
deadline = time.monotonic() + float(sys.argv[3])  # for a lease: time for the next renewal to find it taken
while not getattr(lock, "lost", False) and time.monotonic() < deadline:
    time.sleep(0.05)
lock.release()
print("lost" if getattr(lock, "lost", False) else "released", flush=True)
"""


def start_holder(cwd: Path, workdir: str, env: dict[str, str], lease_s: float = 120,
                 wait_for_loss: float = 0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, workdir, str(lease_s), str(wait_for_loss)], cwd=cwd,
                            env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held", proc.communicate()
    return proc


def test_lock_of_a_killed_run_is_taken_over_with_a_note_and_released_on_error(rundir):
    holder = start_holder(rundir, str(rundir / "w"), cli_env())
    holder.kill()  # SIGKILL: no finally, the record stays; the kernel drops the flock
    holder.communicate()
    assert read_record(rundir / "w" / LOCK)["pid"] == holder.pid

    run = subprocess.run(run_args("w", closed_port_uri()), cwd=rundir, env=cli_env(), capture_output=True,
                         text=True, timeout=120)
    notes = [line for line in run.stderr.splitlines() if line.startswith("bertpipe: note:")]
    assert len(notes) == 1, run.stderr
    assert "took over the workdir lock" in notes[0] and f"pid {holder.pid} is no longer running" in notes[0]
    assert "command: holder --of the test" in notes[0]
    # The run then stopped at its MLflow check (nothing answers at the URI), and released the lock on the way out.
    assert run.returncode == 2 and "does not answer (Connection refused)" in run.stderr, run.stderr
    assert not (rundir / "w" / LOCK).exists()


def test_normal_exit_releases_and_removes_the_folders_the_lock_made(rundir):
    holder = start_holder(rundir, str(rundir / "new" / "w"), cli_env())
    assert read_record(rundir / "new" / "w" / LOCK)["command"] == "holder --of the test"
    out, err = holder.communicate(input="", timeout=60)
    assert out.split() == ["released"], err
    assert not (rundir / "new").exists()  # nothing else was written there, so the folders it created are gone too


def test_one_process_cannot_take_a_workdir_twice(tmp_path):
    """In-process callers (the CLI's main() run by tests, an embedding program) get the same rule as processes."""
    from bertpipe.pipeline.framework.workdir_lock import WorkdirBusy, acquire, hold

    with hold(str(tmp_path / "w"), command="outer"):
        with pytest.raises(WorkdirBusy, match=f"pid {os.getpid()}, .*command: outer"):
            acquire(str(tmp_path / "w"), command="inner")
    acquire(str(tmp_path / "w"), command="again").release()
    assert list(tmp_path.iterdir()) == []


def test_record_from_another_host_is_not_taken_over(rundir):
    lock = rundir / "w" / LOCK
    lock.parent.mkdir()
    lock.write_text(json.dumps({"host": "elsewhere-7", "pid": 4242, "started": time.time() - 60,
                                "command": "bertpipe run --config big"}))
    run = subprocess.run(run_args("w", closed_port_uri()), cwd=rundir, env=cli_env(), capture_output=True,
                         text=True, timeout=120)
    line = run.stderr.strip()
    assert run.returncode == 2 and len(line.splitlines()) == 1, run.stderr
    assert "host elsewhere-7, pid 4242" in line and "command: bertpipe run --config big" in line
    assert "another host" in line and "delete the lock file" in line
    assert read_record(lock)["host"] == "elsewhere-7"  # the refused run left the record as it was
    assert tree(rundir / "w") == {LOCK: lock.stat().st_size}


def test_refused_preflight_leaves_no_folder_behind(rundir):
    """The lock is taken before preflight, in a workdir it had to create: a refusal removes both again."""
    args = run_args("fresh/w", closed_port_uri())
    args[args.index("vocab.input=corpus.txt")] = "vocab.input=missing.txt"
    run = subprocess.run(args, cwd=rundir, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "missing.txt" in run.stderr, run.stderr
    assert not (rundir / "fresh").exists()


# ---------------------------------------------------------------------------------------------------------
# s3:// workdirs: a lease on a conditionally written object


@pytest.fixture(scope="module")
def s3_endpoint():
    pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    port = free_port_block(1)
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert server.poll() is None and time.monotonic() < deadline, "moto server did not start"
            time.sleep(0.1)
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket="bertpipe-test")
        yield env
    finally:
        server.terminate()
        server.wait(timeout=30)


def s3_lock_exists(env: dict[str, str], key: str) -> bool:
    import boto3
    from botocore.exceptions import ClientError

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    try:
        client.head_object(Bucket="bertpipe-test", Key=key)
        return True
    except ClientError:
        return False


def test_s3_workdir_lease_refuses_then_expires_and_is_taken_over(rundir, s3_endpoint):
    workdir = "s3://bertpipe-test/runs/w"
    env = cli_env(**s3_endpoint)
    # Renewed every second; 4 s leave a loaded machine three seconds of slack before a renewal counts as missed.
    holder = start_holder(rundir, workdir, env, lease_s=4.0, wait_for_loss=60)
    try:
        time.sleep(2.5)  # a renewal or two: the lease is kept alive, not just created
        refused = subprocess.run(run_args(workdir, closed_port_uri()), cwd=rundir, env=env, capture_output=True,
                                 text=True, timeout=120)
        line = refused.stderr.strip()
        assert refused.returncode == 2 and len(line.splitlines()) == 1, refused.stderr
        assert f"host {HOST}, pid {holder.pid}" in line and "command: holder --of the test" in line
        assert "lease renewed" in line

        # A frozen holder renews nothing: once its lease has run out, the next run takes the workdir over.
        holder.send_signal(signal.SIGSTOP)
        time.sleep(4.5)
        run = subprocess.run(run_args(workdir, closed_port_uri()), cwd=rundir, env=env, capture_output=True,
                             text=True, timeout=120)
        notes = [x for x in run.stderr.splitlines() if x.startswith("bertpipe: note:")]
        assert len(notes) == 1 and "its lease ran out" in notes[0] and f"pid {holder.pid}" in notes[0], run.stderr
        assert run.returncode != 0  # nothing answers at the MLflow URI; the lock was released on the way out
        assert not s3_lock_exists(s3_endpoint, "runs/w/.bertpipe.lock")
    finally:
        holder.send_signal(signal.SIGCONT)
    out, err = holder.communicate(input="", timeout=120)  # its next renewal finds the lease gone
    assert out.split()[-1] == "lost" and "lost the workdir lock" in err
