"""A failed run's traceback where whoever looks can read it (issue 32, item 6).

A local workdir: the console keeps its three lines and the traceback is in <workdir>/logs/run-<time>.log. A remote
workdir (here s3:// on a real local S3 server, moto's): the traceback is on stderr too (a submitted Ray job's log),
the log file is written on this machine (<temp dir>/bertpipe-logs/...), named in the last lines, and copied to
<workdir>/logs/ when the run ends. The failure: the MLflow store's folder is a file, so the run fails opening it,
after its log file exists and before any stage (no Ray starts): the real CLI, in a few seconds.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_workdir_lock import s3_endpoint  # noqa: F401 - the fixture: a moto S3 server, bucket bertpipe-test

BIN = Path(sys.executable).parent
FIRST = "bertpipe: run failed before or between its stages: [Errno 17] File exists: "


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_", "AWS_"))}
    env.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", **extra)
    return env


def failing_run(home: Path, workdir: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    (home / "corpus.txt").write_text("One sentence. Two sentences.\n\nAnother document.\n")
    (home / "not-a-folder").write_text("")
    return subprocess.run([str(BIN / "bertpipe"), "run", "--workdir", workdir, "--only", "vocab", "--set",
                           "vocab.input=corpus.txt", "--set", f"mlflow.tracking_uri=sqlite:///{home}/not-a-folder/m.db"],
                          cwd=home, env=env, capture_output=True, text=True, timeout=120)


def s3_object(env: dict[str, str], key: str) -> bytes:
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    return client.get_object(Bucket="bertpipe-test", Key=key)["Body"].read()


def test_remote_workdir_failure_has_its_traceback_on_stderr_in_a_local_log_and_beside_the_outputs(
        tmp_path, s3_endpoint):  # noqa: F811
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = cli_env(**s3_endpoint, TMPDIR=str(tmp))
    run = failing_run(tmp_path, "s3://bertpipe-test/logs-test/w", env)
    assert run.returncode == 1, run.stderr
    lines = run.stderr.strip().splitlines()
    # The traceback first, between its marker lines; the three closing lines last.
    start, end = lines.index("bertpipe: the failure's traceback:"), lines.index("bertpipe: (end of the traceback)")
    assert lines[start + 1] == "Traceback (most recent call last):" and end == len(lines) - 4, run.stderr
    assert lines[end - 1].startswith("FileExistsError: [Errno 17] File exists: "), run.stderr
    assert lines[-3].startswith(FIRST), lines
    m = re.fullmatch(r"bertpipe: full log, with the traceback: (\S+) \(copied to "
                     r"(s3://bertpipe-test/logs-test/w/logs/(run-\d{8}-\d{6}\.log))\)", lines[-2])
    assert m, lines[-2]
    assert lines[-1].startswith("bertpipe: after fixing it, resume with: bertpipe run --config tiny --workdir "
                                "s3://bertpipe-test/logs-test/w "), lines[-1]

    local = Path(m.group(1))
    assert local.parent == tmp / "bertpipe-logs" / "s3-bertpipe-test-logs-test-w" and local.name == m.group(3)
    text = local.read_text()
    assert "Traceback (most recent call last):" in text and "FileExistsError: [Errno 17]" in text
    assert f"  log       {local}   (copied to {m.group(2)} when the run ends)" in run.stdout.splitlines()

    copied = s3_object(env, f"logs-test/w/logs/{m.group(3)}").decode()
    assert "Traceback (most recent call last):" in copied and "FileExistsError: [Errno 17]" in copied
    assert text.startswith(copied)  # the file as it was when the run ended (the lock's release may follow)


@pytest.mark.parametrize("submitted", [False, True], ids=["laptop", "submitted-ray-job"])
def test_local_workdir_failure_keeps_three_lines_unless_a_submitted_ray_job(tmp_path, submitted):
    # Ray's job supervisor gives a submitted job's driver this variable (the job's config as JSON).
    job = {"RAY_JOB_CONFIG_JSON_ENV_VAR": '{"metadata": {"job_submission_id": "raysubmit_test"}}'} if submitted else {}
    run = failing_run(tmp_path, "w", cli_env(**job))
    assert run.returncode == 1, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[-3].startswith(FIRST), lines
    m = re.fullmatch(r"bertpipe: full log, with the traceback: (\S+)", lines[-2])
    assert m and Path(m.group(1)).parent == tmp_path / "w" / "logs", lines[-2]
    assert lines[-1].startswith("bertpipe: after fixing it, resume with: bertpipe run "), lines[-1]
    assert "FileExistsError: [Errno 17]" in Path(m.group(1)).read_text()
    if submitted:
        assert lines[0] == "bertpipe: the failure's traceback:" and lines[-4] == "bertpipe: (end of the traceback)"
        assert "Traceback (most recent call last):" in run.stderr and "FileExistsError: [Errno 17]" in run.stderr
    else:
        assert len(lines) == 3 and "Traceback" not in run.stderr, run.stderr


def test_copy_log_puts_the_log_beside_the_outputs_and_into_the_mlflow_run(tmp_path, s3_endpoint,  # noqa: F811
                                                                         monkeypatch):
    """The copy at the end of a remote workdir's run, in-process: the workdir (a real S3 server) and the workflow
    run's artifacts (a real MLflow SQLite store), after that run ended FAILED."""
    import mlflow

    from bertpipe.jobs import cli
    from bertpipe.jobs.services.tracking import start_workflow_run

    for key, value in s3_endpoint.items():
        monkeypatch.setenv(key, value)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = start_workflow_run(uri, "logs", "run", {"seed": 1}, {}, artifact_root=str(tmp_path / "artifacts"))
    parent.close("failed", {})
    log = tmp_path / "run-20260101-000000.log"
    log.write_text("INFO bertpipe: stage x failed\nTraceback (most recent call last):\nValueError: boom\n")
    dest = "s3://bertpipe-test/copy-test/w/logs/run-20260101-000000.log"
    assert cli._log_copy_uri("s3://bertpipe-test/copy-test/w", str(log)) == dest
    assert cli._copy_log(str(log), dest, parent.coordinates) == ""
    assert s3_object(s3_endpoint, "copy-test/w/logs/run-20260101-000000.log") == log.read_bytes()
    got = mlflow.MlflowClient(uri).download_artifacts(parent.run_id, "logs", str(tmp_path / "dl"))
    assert (Path(got) / log.name).read_bytes() == log.read_bytes()
    # A store that refuses the copy: one line saying why; the local file is still the log.
    assert "no-such-bucket" in cli._copy_log(str(log), "s3://no-such-bucket/w/logs/x.log", {})
