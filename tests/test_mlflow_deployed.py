"""MLflow as infra/mlflow/mlflow.yaml deploys it, for real: PostgreSQL (initdb in a temporary folder, on loopback)
as the backend store, S3 (moto's server, S3's HTTP API) behind the server's artifact proxy, the schema migrated by
the init container's command and the server started with the manifest's own arguments. The tiny workflow runs
against it with `bertpipe run`, the way a user runs it: its runs, metrics, the registered model and its artifacts
are read back, the artifacts are found in the bucket (the client had no S3 credentials: they went through the
proxy), and the model loads from the registry.

The slow test kills the server during pre-training and starts it again 40 s later, as the issue did: training goes
on at its speed meanwhile, the console has one line for the outage and one for its end (no urllib3 or MLflow
warning), and every loss point arrives.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from mlflow_rig import MlflowServer, MotoS3, Postgres, quiet_env
from waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "infra" / "mlflow" / "mlflow.yaml"
BIN = Path(sys.executable).parent
BUCKET = "bertpipe-mlflow"
# The tiny workflow made short: its plumbing is under test here, not its learning.
SHORT = ["pretrain.max_steps=6", "pretrain.checkpoint_every_steps=3", "pretrain.log_every_steps=2",
         "pretrain.eval_every_steps=0", "glue.tasks=[MRPC]", "glue.learning_rates=[1e-4]", "glue.num_epochs=1",
         "ray.dashboard=false", "vocab.vocab_size=2000"]

pytestmark = pytest.mark.integration


def manifest_server() -> tuple[list[str], dict[str, str], str, str]:
    """The Deployment's server container as the manifest writes it: (arguments after `mlflow server`, its plain
    env values, the init container's command, the backend URI's scheme from the Secret the header says to create)."""
    docs = {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    server = pod["containers"][0]
    assert server["command"] == ["mlflow", "server"]
    env = {e["name"]: e["value"] for e in server.get("env", []) if "value" in e}
    upgrade = pod["initContainers"][0]["command"][-1]
    scheme = re.search(r"--from-literal=uri='(\w[\w+]*)://", MANIFEST.read_text()).group(1)
    return list(server["args"]), env, upgrade, scheme


def local_args(args: list[str]) -> list[str]:
    """The manifest's arguments on one loopback machine: host and port are the rig's, one worker (2 cores), the
    test's bucket in place of CHANGE-ME; everything else as written."""
    out = []
    for arg in args:
        name, _, value = arg.partition("=")
        if name in ("--host", "--port"):
            continue
        if name == "--workers":
            value = "1"
        if name == "--artifacts-destination":
            assert value.startswith("s3://CHANGE-ME/"), value
            value = value.replace("CHANGE-ME", BUCKET, 1)
        out.append(f"{name}={value}")
    return out


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    why_not = Postgres.available()
    if why_not:
        pytest.skip(why_not)
    pytest.importorskip("psycopg2", reason="the server's PostgreSQL driver (psycopg2-binary, in the test extras)")
    pytest.importorskip("moto.server")
    root = tmp_path_factory.mktemp("deployed")
    args, env, upgrade, scheme = manifest_server()
    db, s3 = Postgres(), MotoS3(BUCKET)
    server = None
    try:
        backend = db.start().replace("postgresql+psycopg2://", f"{scheme}://", 1)
        s3.start()
        # What the pod has: the Secret's URI, the manifest's env, and S3 access (IRSA there, moto's keys here).
        server_env = quiet_env(**{"MLFLOW_BACKEND_STORE_URI": backend, **env, **s3.env,
                                  "MLFLOW_S3_ENDPOINT_URL": s3.endpoint})
        assert upgrade == 'mlflow db upgrade "$MLFLOW_BACKEND_STORE_URI"'
        migrated = subprocess.run(["sh", "-c", upgrade], env={**server_env, "PATH": f"{BIN}:{os.environ['PATH']}"},
                                  capture_output=True, text=True, timeout=300)
        assert migrated.returncode == 0, migrated.stderr[-3000:]
        server = MlflowServer(local_args(args), server_env, root / "server.log")
        server.start()
        yield {"server": server, "s3": s3, "root": root}
    finally:
        if server is not None:
            server.stop()
        s3.stop()
        db.stop()


def bertpipe_run(workdir: Path, uri: str, dump: Path, extra: list[str], lines: list[str] | None = None,
                 timeout: float = 900, only: str = "") -> subprocess.CompletedProcess:
    """`bertpipe run --config tiny` against the server, as a user's shell runs it: no AWS keys (artifacts go through
    the server), Ray in a temp dir of its own. Console lines are collected as they come when `lines` is given."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="bpml-", dir="/tmp"))  # Ray's socket paths must stay short
    argv = [str(BIN / "bertpipe"), "run", "--config", "tiny", "--workdir", str(workdir),
            "--set", f"mlflow.tracking_uri={uri}", "--set", f"clean.input=[{dump}]"]
    for item in SHORT + extra:
        argv += ["--set", item]
    argv += ["--only", only] if only else []
    env = quiet_env(RAY_TMPDIR=str(ray_tmp), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(argv, cwd=workdir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    out: list[str] = lines if lines is not None else []
    reader = threading.Thread(target=lambda: out.extend(line.rstrip("\n") for line in proc.stdout), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        reader.join(30)
    return subprocess.CompletedProcess(shlex.join(argv), proc.returncode, "\n".join(out), "")


def runs_by_name(client, experiment_id: str) -> dict[str, object]:
    return {r.info.run_name: r for r in client.search_runs([experiment_id], max_results=1000)}


def test_the_tiny_workflow_on_postgresql_and_s3(deployed, tmp_path, enwiki_sample):
    import mlflow
    import numpy as np
    import pandas as pd

    server, s3 = deployed["server"], deployed["s3"]
    done = bertpipe_run(tmp_path / "w", server.uri, enwiki_sample, [])
    assert done.returncode == 0, done.stdout[-5000:]

    client = mlflow.MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("bertpipe")
    assert experiment.artifact_location.startswith("mlflow-artifacts:")  # served: clients never see the bucket
    runs = runs_by_name(client, experiment.experiment_id)
    workflow = next(r for name, r in runs.items() if name.startswith("tiny #1"))
    assert workflow.info.status == "FINISHED" and workflow.data.tags["bertpipe.status"] == "succeeded"
    for stage in ("clean", "vocab", "pairs", "pretrain", "glue"):
        assert runs[stage].info.status == "FINISHED", stage
        assert runs[stage].data.tags["mlflow.parentRunId"] == workflow.info.run_id, stage
    pretrain = runs["pretrain"]
    assert pretrain.data.params["pretrain.max_steps"] == "6"
    # The worker's windows (every 2 steps and the phase ends: 5 steps at seq 128, 1 at 512) reached PostgreSQL.
    assert sorted(m.step for m in client.get_metric_history(pretrain.info.run_id, "train/loss")) == [2, 4, 5, 6]
    assert "eval/mlm_accuracy" in pretrain.data.metrics and workflow.data.metrics

    version = client.get_model_version_by_alias("bertpipe-tiny", "newest")
    assert version.version == "1" and version.run_id == pretrain.info.run_id
    listed = {a.path for a in client.list_artifacts(pretrain.info.run_id)}
    assert {"deepspeed_config.json", "export"} <= listed, listed
    keys = s3.keys("bertpipe/mlflow-artifacts/")
    names = {k.rsplit("/", 1)[-1] for k in keys}
    assert {"MLmodel", "model.safetensors", "vocab.txt", "config.json", "pyfunc_model.py",
            "deepspeed_config.json", "_MANIFEST.json"} <= names, sorted(names)
    assert any(pretrain.info.run_id in k for k in keys)

    mlflow.set_tracking_uri(server.uri)  # conftest puts the session's back afterwards
    model = mlflow.pyfunc.load_model(f"models:/bertpipe-tiny/{version.version}")
    hidden = model.predict(pd.DataFrame({"input_ids": [[2, 10, 11, 3], [2, 12, 3, 13, 14, 3]]}))
    assert np.asarray(hidden).shape == (2, 64) and np.isfinite(np.asarray(hidden)).all()


@pytest.mark.slow
def test_a_40_second_outage_during_pretraining(deployed, tmp_path, enwiki_sample):
    """Killed once pre-training has logged its step-50 window, started again 40 s later (as in the issue): steps go
    on meanwhile, the console says unreachable and back once each and shows no library warning, and all 60 loss
    points of the 300 steps are in the store. The step times before and during the outage are printed (a
    measurement, not asserted)."""
    import mlflow

    server = deployed["server"]
    client = mlflow.MlflowClient(server.uri)
    lines: list[str] = []
    steps = ["pretrain.max_steps=300", "pretrain.log_every_steps=5", "pretrain.checkpoint_every_steps=100"]
    result: list[subprocess.CompletedProcess] = []
    runner = threading.Thread(target=lambda: result.append(bertpipe_run(
        tmp_path / "w", server.uri, enwiki_sample, steps, lines, only="clean,vocab,pairs,pretrain")))
    runner.start()

    def pretrain_run():
        found = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                   "attributes.run_name = 'pretrain'", order_by=["start_time DESC"], max_results=1)
        return found[0] if found else None

    def logged_steps(run_id: str) -> list:
        return client.get_metric_history(run_id, "train/loss")

    wait_until(lambda: (r := pretrain_run()) is not None and any(m.step >= 50 for m in logged_steps(r.info.run_id)),
               "the step-50 window", 900, still_running=runner.is_alive, why_stopped=lambda: "\n".join(lines[-30:]))
    run_id = pretrain_run().info.run_id
    server.stop()
    down_at = time.time()
    time.sleep(40)
    server.start()
    up_at = time.time()
    runner.join(900)
    assert result and result[0].returncode == 0, "\n".join(lines[-40:])

    history = sorted(logged_steps(run_id), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(5, 301, 5))
    during = [m for m in history if down_at * 1000 < m.timestamp < up_at * 1000]
    before = [m for m in history if m.timestamp <= down_at * 1000]
    # Training went on: windows were logged (each point is stamped when logged) while the server was down. A worker
    # that waited for MLflow would have logged one and then stood still until the server was back.
    assert len(during) >= 3, [(m.step, m.timestamp) for m in history]

    def ms_per_step(ms: list) -> list[float]:  # phase 1 only: seq 512 steps take longer whenever they come
        return sorted((b.timestamp - a.timestamp) / (b.step - a.step) for a, b in zip(ms, ms[1:]) if b.step <= 270)

    outage, earlier = ms_per_step(during), ms_per_step(before)
    print(f"\nkilled after step {before[-1].step}; windows logged during the 40 s: {len(during)} (steps "
          f"{during[0].step}-{during[-1].step}); ms per step at seq 128 before: median {earlier[len(earlier) // 2]:.0f}"
          f", max {earlier[-1]:.0f}; during: median {outage[len(outage) // 2]:.0f}, max {outage[-1]:.0f}")
    print("\n".join(line for line in lines if "mlflow" in line.lower()))
    console = "\n".join(lines)
    assert len(re.findall(r"is unreachable", console)) == 1 and len(re.findall(r" is back after ", console)) == 1, \
        console[-5000:]
    assert "urllib3" not in console and "Retrying" not in console and "WARNING" not in console, console[-5000:]
