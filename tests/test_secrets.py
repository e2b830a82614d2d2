"""No secret printed, logged, tagged or written: the masking helper, the real CLI's console and traceback, a real
MLflow store's params, tags and artifacts, `bertpipe submit` refusing secrets in a job's env, and the Ray token
file a local run writes."""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bertpipe.pipeline.framework.redact import install_log_masking, is_secret_name, mask, mask_data

BIN = Path(sys.executable).parent
PASSWORD = "Hunter2-x9Q"  # what must never appear


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_", "AWS_"))}
    env.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", **extra)
    return env


@pytest.mark.parametrize("text,expected", [
    (f"http://alice:{PASSWORD}@mlflow:5000/", "http://alice:***@mlflow:5000/"),
    (f"postgresql://mlflow:{PASSWORD}@db:5432/mlflow", "postgresql://mlflow:***@db:5432/mlflow"),
    (f"s3://bucket/w?region=eu&secret_key={PASSWORD}", "s3://bucket/w?region=eu&secret_key=***"),
    (f"https://h/x?X-Amz-Signature={PASSWORD}&X-Amz-Date=1", "https://h/x?X-Amz-Signature=***&X-Amz-Date=1"),
    (f"env AWS_SECRET_ACCESS_KEY={PASSWORD} TOKENIZERS_PARALLELISM=false",
     "env AWS_SECRET_ACCESS_KEY=*** TOKENIZERS_PARALLELISM=false"),
    (f"--set mlflow.password={PASSWORD} --set pairs.dupe_factor=3",
     "--set mlflow.password=*** --set pairs.dupe_factor=3"),
    (f"Authorization: Bearer {PASSWORD}", "Authorization: Bearer ***"),
    ("https://ghp_0123456789abcdefghijklmnopqrstuvwxyz@github.com/o/r", "https://***@github.com/o/r"),
    # Nothing to mask: left exactly as it was.
    ("sqlite:////work/tiny/mlflow.db and ssh://git@host/repo and 3 tokens", None),
    ("Token authentication is enabled for this Ray cluster", None),
])
def test_mask_keeps_who_and_where_and_drops_the_secret(text, expected):
    assert mask(text) == (text if expected is None else expected)


def test_secret_names():
    secret = ["AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "HF_TOKEN", "MLFLOW_TRACKING_TOKEN", "GITHUB_TOKEN",
              "MLFLOW_TRACKING_PASSWORD", "OPENAI_API_KEY", "DB_PASS", "GOOGLE_APPLICATION_CREDENTIALS", "apikey"]
    plain = ["TOKENIZERS_PARALLELISM", "MLFLOW_TRACKING_URI", "RAY_AUTH_MODE", "AWS_DEFAULT_REGION", "PWD",
             "pairs.max_predictions_per_seq", "KEYBOARD_LAYOUT", "num_tokens"]
    assert [n for n in secret if not is_secret_name(n)] == []
    assert [n for n in plain if is_secret_name(n)] == []
    data = {"mlflow": {"tracking_uri": f"http://u:{PASSWORD}@h"}, "password": PASSWORD, "inputs": [f"x?sig={PASSWORD}"]}
    assert PASSWORD not in json.dumps(mask_data(data))


def test_log_records_and_their_tracebacks_are_masked_in_a_real_log_file(tmp_path):
    install_log_masking()
    path = tmp_path / "run.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("bertpipe.test_secrets")
    logger.addHandler(handler)
    try:
        logger.warning("connecting to %s", f"http://bob:{PASSWORD}@mlflow:5000")
        try:
            raise ConnectionError(f"API request to http://bob:{PASSWORD}@mlflow:5000/api failed")
        except ConnectionError:
            logger.exception("stage failed")
    finally:
        logger.removeHandler(handler)
        handler.close()
    text = path.read_text()
    assert PASSWORD not in text
    assert "connecting to http://bob:***@mlflow:5000" in text
    assert "ConnectionError: API request to http://bob:***@" in text


def test_run_masks_the_tracking_password_in_header_and_traceback(tmp_path):
    (tmp_path / "corpus.txt").write_text("One sentence. Two sentences.\n\nAnother document.\n")
    uri = f"http://alice:{PASSWORD}@127.0.0.1:{closed_port()}/"
    run = subprocess.run([str(BIN / "bertpipe"), "run", "--workdir", "w", "--only", "vocab", "--set",
                          "vocab.input=corpus.txt"], cwd=tmp_path, env=cli_env(MLFLOW_TRACKING_URI=uri),
                         capture_output=True, text=True, timeout=120)
    # Nothing answers there: the check before the run says so in one line, naming the URI masked. (The header with
    # a reachable server's masked URI: tests/test_faults.py, against a real MLflow server.)
    assert run.returncode == 2 and run.stdout == "", run.stdout
    assert re.fullmatch(r"bertpipe: error: the MLflow server at http://alice:\*\*\*@127\.0\.0\.1:\d+/ does not "
                        r"answer \(Connection refused\);.*\n", run.stderr), run.stderr
    assert PASSWORD not in run.stdout + run.stderr
    for path in (tmp_path / "w").rglob("*"):
        assert not path.is_file() or PASSWORD not in path.read_text(errors="replace"), path

    # A credential in an input URI: the one-line refusal names the input, masked.
    bad = subprocess.run([str(BIN / "bertpipe"), "run", "--workdir", "w", "--only", "vocab", "--set",
                          f"vocab.input=ftp://carol:{PASSWORD}@127.0.0.1:{closed_port()}/corpus.txt"],
                         cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "carol:***@127.0.0.1" in bad.stderr, bad.stderr
    assert PASSWORD not in bad.stdout + bad.stderr


def test_mlflow_params_tags_and_artifacts_are_masked(tmp_path):
    import mlflow

    from bertpipe.jobs.services.tracking import start_workflow_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = {"mlflow": {"tracking_uri": f"http://alice:{PASSWORD}@mlflow:5000"},
              "clean": {"input": [f"s3://dumps/enwiki.xml.bz2?secret_key={PASSWORD}"]}}
    parent = start_workflow_run(uri, "secrets", "run", config, {"bertpipe.source": f"https://x:{PASSWORD}@h/r"},
                                artifact_root=str(tmp_path / "artifacts"))
    child = parent.child("clean", {"bertpipe.stage": "clean"})
    child.log_params(config)
    try:
        raise ConnectionError(f"cannot reach http://alice:{PASSWORD}@mlflow:5000")
    except ConnectionError as exc:
        import traceback

        child.fail(exc, traceback.format_exc())
    parent.end(False)

    client = mlflow.MlflowClient(uri)
    texts = []
    for run_id in (parent.run_id, child.run_id):
        data = client.get_run(run_id).data
        texts += [json.dumps(data.params), json.dumps(data.tags)]
        local = client.download_artifacts(run_id, "", str(tmp_path / f"dl-{run_id}"))
        texts += [p.read_text() for p in Path(local).rglob("*") if p.is_file()]
    everything = "\n".join(texts)
    assert PASSWORD not in everything
    # Still useful: who and where are there, masked.
    assert "alice:***@mlflow:5000" in everything and "secret_key=***" in everything
    assert "traceback.txt" in str([a.path for a in client.list_artifacts(child.run_id)])


def submit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "bertpipe"), "submit", "--address", f"http://127.0.0.1:{closed_port()}", *args],
                          env=cli_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("item,needle", [
    (f"AWS_SECRET_ACCESS_KEY={PASSWORD}", "--env AWS_SECRET_ACCESS_KEY: refused"),
    (f"HF_TOKEN={PASSWORD}", "--env HF_TOKEN: refused"),
    (f"MLFLOW_TRACKING_URI=http://alice:{PASSWORD}@mlflow:5000", "--env MLFLOW_TRACKING_URI: refused"),
])
def test_submit_refuses_secrets_in_the_jobs_env(item, needle):
    out = submit("--env", item, "--", "run")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert needle in lines[0] and "Kubernetes Secret" in lines[0] and "Ray head's own environment" in lines[0]
    assert PASSWORD not in out.stdout + out.stderr


def test_submit_passes_plain_env_on_to_the_cluster_check():
    """The refusal is for secrets only: a plain --env gets as far as looking for the cluster."""
    out = submit("--env", "TOKENIZERS_PARALLELISM=true", "--", "run")
    assert out.returncode == 2 and "no Ray cluster answers" in out.stderr, out.stderr


def test_job_env_forwards_the_tracking_uri_without_credentials():
    from bertpipe.jobs.submit import SecretInEnv, job_env

    environ = {"MLFLOW_TRACKING_URI": f"https://alice:{PASSWORD}@mlflow.example:443/",
               "MLFLOW_TRACKING_TOKEN": PASSWORD, "AWS_DEFAULT_REGION": "eu-west-1", "HOME": "/home/u"}
    env, notes = job_env(environ, ["PAIRS_DEBUG=1"])
    assert env == {"TOKENIZERS_PARALLELISM": "false", "MLFLOW_TRACKING_URI": "https://mlflow.example:443/",
                   "AWS_DEFAULT_REGION": "eu-west-1", "PAIRS_DEBUG": "1"}
    assert len(notes) == 2 and PASSWORD not in " ".join(notes)
    assert "MLFLOW_TRACKING_TOKEN not forwarded" in notes[1]
    with pytest.raises(SecretInEnv):
        job_env({}, [f"DB_PASSWORD={PASSWORD}"])


def test_local_ray_token_is_written_private(tmp_path, monkeypatch):
    from bertpipe.jobs.cluster import ensure_private_token

    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    path = ensure_private_token()
    assert path == tmp_path / ".ray" / "auth_token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and re.fullmatch(r"[0-9a-f]{64}", path.read_text())

    # One that an earlier Ray wrote world-readable is made private, its token kept.
    path.chmod(0o644)
    token = path.read_text()
    assert ensure_private_token() == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == token

    # The user's own token, or token auth off: nothing written.
    monkeypatch.setenv("HOME", str(tmp_path / "other"))
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "mine"))
    assert ensure_private_token() is None
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert ensure_private_token() is None
    assert not (tmp_path / "other").exists()


@pytest.mark.integration
def test_local_ray_starts_on_the_private_token(tmp_path):
    """A real local Ray started the way a run starts it: it uses the 0600 token and does not rewrite it."""
    code = ("from bertpipe.jobs.cluster import ensure_ray; import ray; ensure_ray(num_cpus=1, dashboard=False); "
            "print('sum', ray.get(ray.remote(lambda: 41 + 1).remote())); ray.shutdown()")
    env = cli_env(HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "sum 42" in out.stdout, out.stderr[-3000:]
    token = tmp_path / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and re.fullmatch(r"[0-9a-f]{64}", token.read_text())
