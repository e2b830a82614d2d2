"""Failures while a run runs end in three lines: a full disk, an error inside a Ray Data task, SIGTERM and SIGINT,
a driver killed with -9 (whose MLflow runs the next run closes), an MLflow server that does not answer.

Every case runs the real `bertpipe` command in a subprocess, on a copy of a workdir whose clean and vocab outputs the
real CLI committed once for the module (the real enwiki sample), with its own local Ray (its own RAY_TMPDIR, so the
test can see which processes are the run's), MLflow in the workdir's SQLite file or a real `mlflow server` on
127.0.0.1, and real signals. A full disk is a real file system: a small tmpfs the test mounts (root only).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from bertpipe.pipeline.stages.pairs import PASS_PARTS_DIR
from ports import closed_port_uri, free_port_block, silent_server
from terminal import as_in_a_terminal

BIN = Path(sys.executable).parent
PASSWORD = "Hunter2-x9Q"  # in the MLflow URI of the SIGTERM test: must never be shown
QUIET = ["--set", "ray.dashboard=false"]  # no dashboard port to collide with another session's


def cli_env(ray_tmp: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
    env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    if ray_tmp is not None:
        env["RAY_TMPDIR"] = str(ray_tmp)
    return env


def bertpipe(cwd: Path, *args: str, ray_tmp: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "bertpipe"), *args], cwd=cwd, env=cli_env(ray_tmp), capture_output=True,
                          text=True, timeout=timeout)


def ray_processes(ray_tmp: Path) -> list:
    """The live processes of the local Ray a run started under `ray_tmp` (Ray hands its environment down). The
    environment is read raw: Ray's process titles overwrite the start of it, and psutil then misses variables."""
    import psutil

    needle = f"\0RAY_TMPDIR={ray_tmp}\0".encode()
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            environ = b"\0" + Path(f"/proc/{proc.pid}/environ").read_bytes()
            if needle in environ and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


@pytest.fixture
def ray_tmp():
    """A short RAY_TMPDIR of the test's own (Ray's socket paths must stay under 108 bytes); whatever Ray process
    of it outlived the test (the -9 test's orphans) is ended by pid afterwards."""
    path = Path(tempfile.mkdtemp(prefix="bpf-", dir="/tmp"))
    yield path
    for proc in ray_processes(path):
        with contextlib.suppress(Exception):
            proc.kill()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def home(tmp_path_factory, enwiki_sample) -> Path:
    """The directory runs start in: the sample where the tiny preset looks for it (data/sample/)."""
    home = tmp_path_factory.mktemp("faults")
    (home / "data" / "sample").mkdir(parents=True)
    os.symlink(enwiki_sample, home / "data" / "sample" / enwiki_sample.name)
    return home


@pytest.fixture(scope="module")
def committed(home) -> Path:
    """clean + vocab committed by the real CLI, once; each test runs `--only pairs` on a copy of it."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="bpf-", dir="/tmp"))
    try:
        run = bertpipe(home, "run", "--workdir", "base", "--only", "clean,vocab", "--set", "mlflow.tracking_uri='off'",
                       *QUIET, ray_tmp=ray_tmp, timeout=600)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return home / "base"


def copy_of(committed: Path, dest: Path) -> Path:
    shutil.copytree(committed, dest, symlinks=True, ignore=shutil.ignore_patterns("logs"))
    return dest


def tree(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}


def temporaries(path: Path) -> list[str]:
    return [str(p.relative_to(path)) for p in path.rglob("*.tmp")]


def assert_closing_lines(stderr: str, first: str, resume_from: str, fixing: bool = True) -> tuple[str, Path]:
    """The run ended with exactly the three lines (cause, log file, resume command) and nothing else on stderr:
    no traceback, no colour codes, no Ray task text, no C++ stack dump. Returns the cause line and the log file."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 3, stderr
    assert lines[0].startswith(f"bertpipe: {first}"), lines
    m = re.fullmatch(r"bertpipe: full log, with the traceback: (\S+)( \(incomplete: .*\))?", lines[1])
    assert m, lines[1]
    resume = "after fixing it, resume with: " if fixing else "resume with: "
    assert lines[2].startswith(f"bertpipe: {resume}bertpipe run ") and lines[2].endswith(f"--from {resume_from}")
    for noise in ("\x1b[", "Traceback", "ray::", "UserCodeException", "*** ", "Aborted"):
        assert noise not in stderr, stderr
    return lines[0], Path(m.group(1))


def runs(tracking_uri: str) -> dict[str, object]:
    """{run name: run} of the bertpipe experiment (workflow runs are named "<config> #<n> · <time>")."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("bertpipe")
    return {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])} if experiment else {}


def start_pairs(home: Path, workdir: Path, ray_tmp: Path, *extra: str) -> tuple[subprocess.Popen, list[str]]:
    """`bertpipe run --only pairs` on `workdir`, returned once its local Ray is up (the console's "ray" line)."""
    # A session of its own: a signal the test sends reaches the run alone, never pytest's process group.
    proc = subprocess.Popen(as_in_a_terminal([str(BIN / "bertpipe"), "run", "--workdir", str(workdir), "--only",
                                              "pairs", *QUIET, *extra]), cwd=home, env=cli_env(ray_tmp),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out = []
    for line in proc.stdout:
        out.append(line.rstrip("\n"))
        if line.startswith("  ray "):
            return proc, out
    raise AssertionError(f"the run ended before Ray started: {out} {proc.communicate()}")


def wait_for_writers(stage: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until the stage's Ray tasks have written into its folder (a part file, or its temporary name)."""
    deadline = time.monotonic() + timeout
    while not any(p.is_file() for p in (stage / "_parts").rglob("*")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no part file appeared"
        time.sleep(0.05)


def interrupt(proc: subprocess.Popen, sig: int, stage: Path) -> None:
    """`sig` to the run while its stage runs, for certain: the driver is stopped (SIGSTOP), the stage's pass-1 folder
    is checked to be still there (the driver deletes it once the writers are done, before the stage commits), and
    only then is the signal sent and the driver let go on into it.

    Checked without the stop, the stage could end between the check and the signal on a loaded machine: the signal
    then reaches a run that has committed its stage, closed its MLflow runs as FINISHED and is in Ray's shutdown at
    interpreter exit, where a KeyboardInterrupt is only "ignored in atexit callback" and the run exits 0."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        assert proc.poll() is None, ("the run ended before the signal", proc.communicate())
        assert (stage / PASS_PARTS_DIR).is_dir(), f"{stage.name} got past its writers before the test could stop it"
        os.kill(proc.pid, sig)  # pending until SIGCONT: delivered with the driver still inside the stage
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def finish(proc: subprocess.Popen, out: list[str]) -> tuple[int, str, str]:
    rest, err = proc.communicate(timeout=300)
    return proc.returncode, "\n".join(out) + "\n" + rest, err


def assert_writers_stopped(workdir: Path, ray_tmp: Path) -> None:
    """Once the run has exited, none of its Ray processes is alive and nothing under its workdir changes."""
    assert ray_processes(ray_tmp) == []
    before = tree(workdir)
    time.sleep(2)
    assert tree(workdir) == before


# ------------------------------------------------------------------------------------------------------------------
# An MLflow server that does not answer: one line before anything is written (no Ray, seconds)


def test_unreachable_mlflow_server_is_one_line_and_nothing_is_written(tmp_path):
    (tmp_path / "corpus.txt").write_text("One sentence here. Another one.\n\nA second document.\n")
    with silent_server() as silent:
        for uri, why in ((closed_port_uri(), "Connection refused"), (silent, "no answer within 5 s")):
            started = time.monotonic()
            run = bertpipe(tmp_path, "run", "--workdir", "w", "--only", "vocab", "--set", "vocab.input=corpus.txt",
                           "--set", f"mlflow.tracking_uri={uri}", timeout=120)
            took = time.monotonic() - started
            lines = run.stderr.strip().splitlines()
            assert run.returncode == 2 and len(lines) == 1, run.stderr
            assert lines[0].startswith(f"bertpipe: error: the MLflow server at {uri} does not answer ({why})")
            assert run.stdout == ""
            assert not (tmp_path / "w").exists()  # no log, no lock, no MLflow record: the folder was never left
            assert took < 60, took  # one request, no retries (before: MLflow's retries, then 102 lines)


# ------------------------------------------------------------------------------------------------------------------
# A full disk


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 12 MB tmpfs: a real file system that fills up. Mounting needs root (CAP_SYS_ADMIN)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount_point)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill up (needs root): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(path: Path) -> None:
    """Write zeros into `path` until the file system has no byte left."""
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 12, 1):
            block = bytes(size)
            with contextlib.suppress(OSError):
                while f.write(block):
                    pass


def test_full_disk_at_start_is_one_line_and_leaves_nothing(tmp_path, small_disk):
    """Before: a 21-line traceback from the lock's write, and its empty lock file left behind."""
    (tmp_path / "corpus.txt").write_text("One sentence here. Another one.\n\nA second document.\n")
    fill(small_disk / "filler")
    run = bertpipe(tmp_path, "run", "--workdir", str(small_disk / "w"), "--only", "vocab", "--set",
                   "vocab.input=corpus.txt", timeout=120)
    assert run.returncode == 1 and run.stderr == "bertpipe: error: [Errno 28] No space left on device\n", run.stderr
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


@pytest.mark.integration
def test_full_disk_ends_in_three_lines_with_no_temporary_file_left(committed, home, small_disk, ray_tmp):
    """The disk fills while the stage's Ray tasks write: the tasks fail, and so would every write of the failure
    handler (MLflow's SQLite store, its traceback artifact, the log file) on the same disk."""
    workdir = copy_of(committed, small_disk / "w")
    proc, out = start_pairs(home, workdir, ray_tmp)
    fill(small_disk / "filler")
    code, stdout, stderr = finish(proc, out)

    assert code == 1, stderr
    cause, log_file = assert_closing_lines(stderr, "stage pairs failed: ", "pairs")
    assert "No space left on device" in cause, cause
    assert log_file.parent == workdir / "logs"
    assert temporaries(workdir) == []  # the tasks' half-written *.tmp files are gone
    assert not (workdir / ".bertpipe.lock").exists()
    assert_writers_stopped(workdir, ray_tmp)

    # With room again, the next run closes the MLflow runs the failed one could not write its end into.
    (small_disk / "filler").unlink()
    again = bertpipe(home, "run", "--workdir", str(workdir), "--only", "clean", ray_tmp=ray_tmp)
    assert again.returncode == 0, again.stderr
    status = {name: run.info.status for name, run in runs(f"sqlite:///{workdir / 'mlflow.db'}").items()}
    assert status["pairs"] in ("FAILED", "KILLED") and "RUNNING" not in status.values(), status


# ------------------------------------------------------------------------------------------------------------------
# An error inside a Ray Data task


@pytest.mark.integration
def test_error_inside_a_ray_data_task_shows_its_cause_only(committed, home, tmp_path, ray_tmp):
    """A committed clean shard rotted in place (same size: only `status --verify` would notice): the pairs stage's
    Ray Data read task fails on it, on a worker. The workdir is given relative to where the user is, and the resume
    command gives it back as typed, with the user's options."""
    rel = f"w-{tmp_path.name}"
    workdir = copy_of(committed, home / rel)
    shard = next((workdir / "clean").glob("docs-*.parquet"))
    data = bytearray(shard.read_bytes())
    data[4:len(data) // 2] = b"\x07" * (len(data) // 2 - 4)  # the data pages; magic bytes and footer intact
    shard.write_bytes(bytes(data))
    run = bertpipe(home, "run", "--workdir", rel, "--only", "pairs", *QUIET, ray_tmp=ray_tmp)

    assert run.returncode == 1, run.stderr
    cause, log_file = assert_closing_lines(run.stderr, "stage pairs failed: ", "pairs")
    assert log_file.parent == workdir / "logs"
    assert run.stderr.splitlines()[2] == ("bertpipe: after fixing it, resume with: bertpipe run --config tiny "
                                          f"--workdir {rel} {' '.join(QUIET)} --from pairs"), run.stderr
    # The worker's own error, named as the worker raised it, and which task (Ray Data's Parquet reader reads a
    # file's metadata in one task, its rows in another): not "ray::ReadParquet...()" in colour.
    assert re.fullmatch(r"bertpipe: stage pairs failed: OSError: .+ \(in Ray task \w+\)", cause), cause
    log = log_file.read_text()
    assert "Traceback" in log and cause.split("failed: ", 1)[1].split(" (in Ray task")[0] in log
    tracked = runs(f"sqlite:///{workdir / 'mlflow.db'}")
    pairs = tracked["pairs"]
    assert pairs.info.status == "FAILED" and "\x1b[" not in pairs.data.tags["bertpipe.error"]
    assert pairs.data.tags["bertpipe.error"] in cause  # the cause the console printed, in MLflow too
    import mlflow

    assert "traceback.txt" in [a.path for a in mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
                               .list_artifacts(pairs.info.run_id)]
    (parent,) = [r for r in tracked.values() if r.data.tags.get("bertpipe.kind") == "workflow"]
    assert parent.info.status == "FAILED" and parent.data.tags["bertpipe.status"] == "failed"
    assert pairs.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert temporaries(workdir) == []
    shutil.rmtree(workdir)


# ------------------------------------------------------------------------------------------------------------------
# SIGTERM and SIGINT


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 (SQLite backend, served artifacts), in a process group of its own."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port_block(1)
    proc = subprocess.Popen([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers",
                             "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination",
                             str(root / "artifacts")],
                            # As infra/local/cluster.sh starts it: without job execution (seven huey consumer
                            # processes these tests have no use for).
                            env={**cli_env(), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300  # a loaded 2-core machine takes a minute to import the server
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                break
            assert proc.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(0.5)
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its group: the server and the workers it started
        proc.wait(timeout=30)


def assert_interrupted(sig: int, code: int, stderr: str, workdir: Path, ray_tmp: Path) -> None:
    name = signal.Signals(sig).name
    assert code == 128 + sig, stderr
    assert_closing_lines(stderr, f"stage pairs interrupted by {name}", "pairs", fixing=False)
    assert not (workdir / ".bertpipe.lock").exists()
    assert not (workdir / ".bertpipe.mlflow-runs.json").exists()  # every MLflow run closed: nothing for the next
    assert temporaries(workdir) == []
    assert_writers_stopped(workdir, ray_tmp)


@pytest.mark.integration
def test_sigterm_stops_the_writers_and_marks_the_mlflow_runs_killed(committed, home, tmp_path, ray_tmp,
                                                                    mlflow_server):
    """After ray.init the local Ray has replaced the SIGTERM handler (before: exit 134 and a C++ stack dump)."""
    workdir = copy_of(committed, tmp_path / "w")
    uri = f"http://alice:{PASSWORD}@127.0.0.1:{mlflow_server}/"
    proc, out = start_pairs(home, workdir, ray_tmp, "--set", f"mlflow.tracking_uri={uri}")
    wait_for_writers(workdir / "pairs", proc)
    interrupt(proc, signal.SIGTERM, workdir / "pairs")
    code, stdout, stderr = finish(proc, out)

    assert_interrupted(signal.SIGTERM, code, stderr, workdir, ray_tmp)
    # The server answered the check, and its URI is shown masked (MLflow's own "View run at <URI>" is not shown).
    assert f"  mlflow    http://alice:***@127.0.0.1:{mlflow_server}/" in stdout.splitlines()
    assert PASSWORD not in stdout + stderr
    assert not [p for p in workdir.rglob("*") if p.is_file() and PASSWORD.encode() in p.read_bytes()]
    found = runs(f"http://127.0.0.1:{mlflow_server}/")
    workflow = next(r for name, r in found.items() if name.startswith("tiny "))
    assert found["pairs"].info.status == "KILLED" and workflow.info.status == "KILLED"
    assert found["pairs"].data.tags["bertpipe.error"] == "interrupted by SIGTERM while stage pairs ran"
    assert workflow.data.tags["bertpipe.status"] == "killed"


# ------------------------------------------------------------------------------------------------------------------
# kill -9: nothing runs in the driver; the next run of the workdir closes what it left


@pytest.mark.integration
def test_runs_a_killed_driver_left_running_are_marked_killed_by_the_next_run(committed, home, tmp_path, ray_tmp):
    workdir = copy_of(committed, tmp_path / "w")
    store = f"sqlite:///{workdir / 'mlflow.db'}"
    proc, out = start_pairs(home, workdir, ray_tmp)
    wait_for_writers(workdir / "pairs", proc)
    proc.kill()
    proc.communicate(timeout=60)
    left = runs(store)
    assert sorted(r.info.status for r in left.values()) == ["RUNNING", "RUNNING"]
    record = json.loads((workdir / ".bertpipe.mlflow-runs.json").read_text())
    assert [r["pid"] for r in record["runs"]] == [proc.pid]

    # The next run: clean is fresh, so no Ray starts; it holds the lock, so the recorded driver is gone for sure.
    nxt = bertpipe(home, "run", "--workdir", str(workdir), "--only", "clean", ray_tmp=ray_tmp)
    assert nxt.returncode == 0, nxt.stderr
    notes = [line for line in nxt.stderr.splitlines() if "MLflow run" in line]
    assert len(notes) == 1 and notes[0].startswith("bertpipe: note: marked 2 MLflow runs"), nxt.stderr
    assert f"pid {proc.pid} on {socket.gethostname()}" in notes[0]
    after = runs(store)
    for name, run in left.items():
        assert after[name].info.status == "KILLED", name
    workflow = next(r for name, r in left.items() if name != "pairs")
    assert f"pid {proc.pid}" in after[workflow.info.run_name].data.tags["bertpipe.error"]
    assert [r.info.status for name, r in after.items() if name not in left] == ["FINISHED", "FINISHED"]
    assert not (workdir / ".bertpipe.mlflow-runs.json").exists()


# ------------------------------------------------------------------------------------------------------------------
# Ctrl-C during pre-training: Ray Train's own SIGINT handler ends fit() with sys.exit(0)


@pytest.mark.integration
def test_sigint_during_pretraining_ends_as_an_interrupt(tmp_path, ray_tmp):
    sys.path.insert(0, str(Path(__file__).parent))
    from pretrain_helpers import make_inputs

    make_inputs(tmp_path / "inputs", lengths=(32,), rows_per_shard=400, num_shards=2, heldout_rows=160)
    (tmp_path / "inputs" / "pairs" / "_MANIFEST.json").unlink()  # shards from anywhere: no manifest of ours
    phase = ("[{max_seq_length: 32, max_predictions_per_seq: 5, global_batch_size: 16, micro_batch_size: 8,"
             " learning_rate: 1.0e-3, warmup_steps: 2}]")
    proc = subprocess.Popen(
        [str(BIN / "bertpipe"), "run", "--workdir", "w", "--only", "pretrain", *QUIET,
         "--set", f"pretrain.input={tmp_path / 'inputs' / 'pairs'}",
         "--set", f"vocab.path={tmp_path / 'inputs' / 'vocab' / 'vocab.txt'}",
         "--set", f"pretrain.phases={phase}", "--set", "pretrain.max_steps=100000",
         "--set", "pretrain.checkpoint_every_steps=2"],  # MLflow in the workdir's SQLite file (the default)
        cwd=tmp_path, env=cli_env(ray_tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Interrupt once the workers have written their first checkpoint (step 2): training is under way inside fit().
    deadline = time.monotonic() + 240
    while not list((tmp_path / "w" / "ray_results").rglob("checkpoint_*")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert_closing_lines(stderr, "stage pretrain interrupted by SIGINT", "pretrain", fixing=False)
    assert not (tmp_path / "w" / ".bertpipe.lock").exists()
    assert not (tmp_path / "w" / "pretrain" / "_MANIFEST.json").exists()
    assert not (tmp_path / "w" / ".bertpipe.mlflow-runs.json").exists()  # every MLflow run closed
    assert_writers_stopped(tmp_path / "w", ray_tmp)  # the Ray Train workers too
    status = {name: r.info.status for name, r in runs(f"sqlite:///{tmp_path / 'w' / 'mlflow.db'}").items()}
    assert sorted(status.values()) == ["KILLED", "KILLED"], status
