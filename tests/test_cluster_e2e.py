"""End to end on real components: infra/local/cluster.sh starts a Ray head (token auth) and an MLflow server;
`bertpipe submit -- run` runs the whole tiny workflow as a Ray job; MLflow is read back over its REST API;
a resubmission skips every stage; `--only pairs --force` reruns just pairs and leaves later stages stale;
the dashboard refuses requests without the token; the cluster stops and nothing is left running.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import USER_RUN_SETTINGS

from ports import free_port_block

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "infra" / "local" / "cluster.sh"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def cluster():
    # A short path: Ray's Unix socket paths under the state dir must stay below 108 bytes.
    state = Path(tempfile.mkdtemp(prefix="bpe2e-", dir="/tmp"))
    token_file = state / "auth_token"
    base = free_port_block(10)
    env = dict(os.environ)
    env.update({
        "BERTPIPE_LOCAL_DIR": str(state / "local"),
        "BERTPIPE_RAY_TOKEN_FILE": str(token_file),
        "BERTPIPE_RAY_PORT": str(base),
        "BERTPIPE_DASHBOARD_PORT": str(base + 8),
        "BERTPIPE_MLFLOW_PORT": str(base + 9),
        "BERTPIPE_NUM_CPUS": "4",
        "PATH": f"{BIN}:{env['PATH']}",
    })
    for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "MLFLOW_TRACKING_URI", "RAY_AUTH_TOKEN"):
        env.pop(key, None)
    started = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr + started.stdout
    client_env = dict(env)
    for line in (state / "local" / "env.sh").read_text().splitlines():
        m = re.match(r"export (\w+)=(.*)", line)
        if m:
            client_env[m.group(1)] = m.group(2)
    try:
        yield {"env": client_env, "state": state, "token": token_file.read_text().strip(),
               "dashboard": client_env["RAY_API_SERVER_ADDRESS"], "mlflow": client_env["MLFLOW_TRACKING_URI"]}
    finally:
        stopped = subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, text=True,
                                 timeout=180)
        assert stopped.returncode == 0, stopped.stderr
        time.sleep(1)
        left = subprocess.run(["pgrep", "-f", str(state)], capture_output=True, text=True).stdout.split()
        assert not left, f"processes left running after stop: {left}"
        shutil.rmtree(state, ignore_errors=True)


def _bertpipe(cluster, *args, timeout=1500) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "bertpipe"), *args], env=cluster["env"], capture_output=True, text=True,
                          timeout=timeout, cwd=cluster["state"])


def _mlflow(cluster, method: str, path: str, body: dict | None = None) -> dict:
    url = cluster["mlflow"].rstrip("/") + "/api/2.0/mlflow/" + path
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def _runs(cluster) -> list[dict]:
    exp = _mlflow(cluster, "GET", "experiments/get-by-name?experiment_name=bertpipe")["experiment"]
    return _mlflow(cluster, "POST", "runs/search",
                   {"experiment_ids": [exp["experiment_id"]], "max_results": 500}).get("runs", [])


def _tags(run: dict) -> dict:
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}


def _children(cluster, parent_id: str) -> dict[str, dict]:
    return {_tags(r)["bertpipe.stage"]: r for r in _runs(cluster) if _tags(r).get("mlflow.parentRunId") == parent_id}


def _latest_parent(cluster) -> dict:
    parents = [r for r in _runs(cluster) if _tags(r).get("bertpipe.kind") == "workflow"]
    return max(parents, key=lambda r: int(r["info"]["start_time"]))


def test_dashboard_refuses_requests_without_the_token(cluster):
    url = cluster["dashboard"] + "/api/version"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url, timeout=10)
    assert err.value.code == 401
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {cluster['token']}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def test_submitted_workflow_runs_every_stage_then_skips_then_reruns_one(cluster, enwiki_sample):
    workdir = cluster["state"] / "work"
    # Shortened (the job's plumbing is under test, not learning): as tests/test_first_run.py's user run.
    common = ["--config", "tiny", "--workdir", str(workdir), "--set", f"clean.input={enwiki_sample}",
              *USER_RUN_SETTINGS]

    t0 = time.time()
    first = _bertpipe(cluster, "submit", "--", "run", *common)  # as the README shows it: follows the job to its end
    wall = time.time() - t0
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    assert re.search(r"^job:\s+\S+", first.stdout, re.M) and "dashboard:" in first.stdout
    to_running = float(re.search(r"job running ([\d.]+) s after submission", first.stdout).group(1))
    print(f"\nsubmit -> job running: {to_running:.1f} s; whole tiny workflow as a job: {wall:.1f} s")
    for stage in ("clean", "vocab", "pairs", "pretrain", "finetune"):
        assert re.search(rf"^{stage}\s+ran\b", first.stdout, re.M), first.stdout[-3000:]

    parent = _latest_parent(cluster)
    assert parent["info"]["status"] == "FINISHED"
    children = _children(cluster, parent["info"]["run_id"])
    assert set(children) >= {"clean", "vocab", "pairs", "pretrain", "finetune"}
    metrics = {s: {m["key"]: m["value"] for m in r["data"].get("metrics", [])} for s, r in children.items()}
    assert metrics["clean"]["num_rows"] > 50
    assert metrics["pairs"]["num_rows"] > 1000
    assert "train/loss" in metrics["pretrain"], metrics["pretrain"]  # the workers' series, under MLflow's sections

    again = _bertpipe(cluster, "submit", "--wait", "--", "run", *common)
    assert again.returncode == 0, again.stdout[-3000:]
    assert len(re.findall(r"^\w+\s+skipped\b", again.stdout, re.M)) == 5, again.stdout[-3000:]
    skipped = _children(cluster, _latest_parent(cluster)["info"]["run_id"])
    assert {_tags(r).get("bertpipe.skipped") for r in skipped.values()} == {"fresh"}

    one = _bertpipe(cluster, "submit", "--wait", "--", "run", *common, "--only", "pairs", "--force")
    assert one.returncode == 0, one.stdout[-3000:]
    assert re.search(r"^pairs\s+ran\b", one.stdout, re.M)
    assert not re.search(r"^(clean|vocab|pretrain|finetune)\s+(ran|skipped)\b", one.stdout, re.M)
    status = _bertpipe(cluster, "status", *common, "--json")
    states = {r["stage"]: r["state"] for r in json.loads(status.stdout)}
    assert states == {"clean": "fresh", "vocab": "fresh", "pairs": "fresh", "pretrain": "stale",
                      "finetune": "stale"}
