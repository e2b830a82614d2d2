"""End to end on real components: infra/local/cluster.sh starts a Ray head (token auth) and an MLflow server;
`bertpipe submit -- run` runs the whole tiny workflow as a Ray job; MLflow is read back over its REST API;
a resubmission skips every stage; `--only pairs --force` reruns just pairs and leaves later stages stale;
the cluster serves on loopback with its own token and prints what a client needs; the dashboard refuses requests
without the token; the CLI's answer to a refused token, and `submit` following a job; the cluster stops, its
ports are free and nothing is left running.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import socket
import stat
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
from waiting import wait_until

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
    user_token = Path.home() / ".ray" / "auth_token"
    user_token_before = user_token.read_bytes() if user_token.exists() else None
    started = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr + started.stdout
    client_env = dict(env)
    for line in (state / "local" / "env.sh").read_text().splitlines():
        m = re.match(r"export (\w+)=(.*)", line)
        if m:
            client_env[m.group(1)] = m.group(2)
    try:
        yield {"env": client_env, "state": state, "token": token_file.read_text().strip(), "script_env": env,
               "printed": started.stdout, "token_file": token_file, "ports": (base, base + 8, base + 9),
               "dashboard": client_env["RAY_API_SERVER_ADDRESS"], "mlflow": client_env["MLFLOW_TRACKING_URI"]}
    finally:
        stopped = subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, text=True,
                                 timeout=180)
        assert stopped.returncode == 0, stopped.stderr
        time.sleep(1)
        left = subprocess.run(["pgrep", "-f", str(state)], capture_output=True, text=True).stdout.split()
        assert not left, f"processes left running after stop: {left}"
        assert not any(_reachable("127.0.0.1", port) for port in (base, base + 8, base + 9))
        status = subprocess.run(["bash", str(SCRIPT), "status"], env=env, capture_output=True, text=True, timeout=60)
        assert status.returncode == 3, status.stdout + status.stderr  # 3: not running
        shutil.rmtree(state, ignore_errors=True)
        # the cluster's own token file: the user's ~/.ray/auth_token is never written
        assert (user_token.read_bytes() if user_token.exists() else None) == user_token_before


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _http_status(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def bertpipe(*args: str, cwd: Path, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "bertpipe"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _bertpipe(cluster, *args, timeout=1500) -> subprocess.CompletedProcess:
    return bertpipe(*args, cwd=cluster["state"], env=cluster["env"], timeout=timeout)


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


def test_the_cluster_serves_on_loopback_with_its_token_and_prints_what_a_client_needs(cluster):
    """infra/local/cluster.sh start: a private random token; the dashboard answers it only (401 without, 403 for a
    wrong one); MLflow serves; nothing listens beyond loopback; the printed export lines are all a client needs
    (the Jobs API and `ray status` accept them, and refuse without RAY_AUTH_MODE); status and a second start report
    the running cluster without starting another. (Stopping it: the fixture's end.)"""
    assert re.fullmatch(r"[0-9a-f]{64}", cluster["token"])
    assert stat.S_IMODE(cluster["token_file"].stat().st_mode) == 0o600
    assert _http_status(cluster["dashboard"] + "/api/version", "0" * 64) == 403
    assert _http_status(cluster["mlflow"] + "/health") == 200
    host_ip = socket.gethostbyname(socket.gethostname())
    if not host_ip.startswith("127."):
        assert not any(_reachable(host_ip, port) for port in cluster["ports"][1:])
    exports = dict(re.findall(r"^export (\w+)=(\S+)$", cluster["printed"], re.M))
    client = {"PATH": cluster["script_env"]["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **exports}
    list_jobs = [sys.executable, "-c", "from ray.job_submission import JobSubmissionClient as C; "
                 "print('jobs', len(C().list_jobs()))"]
    ok = subprocess.run(list_jobs, env=client, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("jobs "), ok.stderr
    no_mode = {k: v for k, v in client.items() if k != "RAY_AUTH_MODE"}
    refused = subprocess.run(list_jobs, env=no_mode, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "auth" in (refused.stdout + refused.stderr).lower()
    ray_status = subprocess.run(["ray", "status"], env=client, capture_output=True, text=True, timeout=120)
    assert ray_status.returncode == 0 and "/4.0 CPU" in ray_status.stdout, ray_status.stdout + ray_status.stderr
    script = cluster["script_env"]
    assert subprocess.run(["bash", str(SCRIPT), "status"], env=script, capture_output=True, timeout=60).returncode == 0
    again = subprocess.run(["bash", str(SCRIPT), "start"], env=script, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "already running" in again.stderr, again.stdout + again.stderr


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
    for stage in ("clean", "vocab", "pairs", "pretrain", "glue"):
        assert re.search(rf"^{stage}\s+ran\b", first.stdout, re.M), first.stdout[-3000:]

    parent = _latest_parent(cluster)
    assert parent["info"]["status"] == "FINISHED"
    children = _children(cluster, parent["info"]["run_id"])
    assert set(children) >= {"clean", "vocab", "pairs", "pretrain", "glue"}
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
    assert not re.search(r"^(clean|vocab|pretrain|glue)\s+(ran|skipped)\b", one.stdout, re.M)
    status = _bertpipe(cluster, "status", *common, "--json")
    states = {r["stage"]: r["state"] for r in json.loads(status.stdout)}
    assert states == {"clean": "fresh", "vocab": "fresh", "pairs": "fresh", "pretrain": "stale",
                      "glue": "stale"}


# ---------------------------------------------------------------------------------------------------------
# The CLI's habits with a token-protected cluster (issue 26, item 5): a refused token is one line, exit 2;
# `submit` follows the job like `ray job submit`. On this module's cluster: no second one started.

def _client_env(cluster: dict, home: Path, **token: str) -> dict[str, str]:
    """The cluster's client env with the token taken away (and a HOME without ~/.ray/auth_token), plus `token`."""
    env = {k: v for k, v in cluster["env"].items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    home.mkdir(exist_ok=True)
    env["HOME"] = str(home)
    env.update(token)
    return env


REFUSED = re.compile(r"^bertpipe: error: the Ray cluster at (\S+) refused authentication \((.+?)\); bertpipe sends "
                     r"the token from RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else ~/\.ray/auth_token "
                     r"\(set it to the cluster's token\)\n$")


@pytest.mark.integration
def test_a_refused_token_is_one_line_with_exit_2(cluster, tmp_path):
    before = bertpipe("jobs", "list", env=cluster["env"], cwd=tmp_path)
    assert before.returncode == 0, before.stderr
    wrong = tmp_path / "wrong_token"
    wrong.write_text("0" * 64)
    (tmp_path / "home2" / ".ray").mkdir(parents=True)
    (tmp_path / "home2" / ".ray" / "auth_token").write_text("e" * 64)
    cases = {
        "no token": (_client_env(cluster, tmp_path / "home"), "no token was sent"),
        "no token, mode on": (_client_env(cluster, tmp_path / "home", RAY_AUTH_MODE="token"),
                              "no token was sent"),
        "wrong RAY_AUTH_TOKEN": (_client_env(cluster, tmp_path / "home", RAY_AUTH_TOKEN="f" * 64),
                                 "it does not accept the token from RAY_AUTH_TOKEN"),
        "wrong token file": (_client_env(cluster, tmp_path / "home", RAY_AUTH_TOKEN_PATH=str(wrong)),
                             f"it does not accept the token from the file {wrong} (RAY_AUTH_TOKEN_PATH)"),
        "wrong ~/.ray/auth_token": (_client_env(cluster, tmp_path / "home2"),
                                    f"it does not accept the token from the file {tmp_path}/home2/.ray/auth_token"),
    }
    commands = [["jobs", "list"], ["jobs", "logs", "raysubmit_x"], ["jobs", "status", "raysubmit_x"],
                ["submit", "--", "--version"], ["submit", "--no-wait", "--", "--version"]]
    # Every way of sending a token with one command, and every command with one way (the refusal is found in one
    # place for all of them): 9 calls of a second each, where every pair would be 25.
    pairs = [(case, commands[0]) for case in cases] + [("wrong RAY_AUTH_TOKEN", c) for c in commands[1:]]
    for case, command in pairs:
        env, why = cases[case]
        out = bertpipe(*command, env=env, cwd=tmp_path)
        assert out.returncode == 2, (case, command, out.stdout, out.stderr)
        m = REFUSED.match(out.stderr)
        assert m, (case, command, out.stderr)
        assert m.group(1) == cluster["dashboard"] and m.group(2) == why, (case, command, out.stderr)
        assert out.stdout == ""
    # Nothing was submitted by the refused calls.
    listed = bertpipe("jobs", "list", env=cluster["env"], cwd=tmp_path)
    assert listed.returncode == 0 and listed.stdout == before.stdout, listed.stderr

    unreadable = _client_env(cluster, tmp_path / "home", RAY_AUTH_TOKEN_PATH=str(tmp_path / "absent"))
    out = bertpipe("jobs", "list", env=unreadable, cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert f"cannot read the Ray token file {tmp_path / 'absent'} that RAY_AUTH_TOKEN_PATH names" in out.stderr
    (tmp_path / "empty").write_text("\n")
    out = bertpipe("jobs", "list", env={**unreadable, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "empty")}, cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert f"the Ray token file {tmp_path / 'empty'} that RAY_AUTH_TOKEN_PATH names is empty" in out.stderr


@pytest.mark.integration
def test_submit_follows_the_job_to_its_end_like_ray_job_submit(cluster, tmp_path):
    env = cluster["env"]
    ok = bertpipe("submit", "--", "--version", env=env, cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"bertpipe {importlib.metadata.version('bertpipe')}\n" in ok.stdout  # the job's own output, followed
    assert re.search(r"^\[bertpipe\] job \S+ SUCCEEDED after", ok.stdout, re.M), ok.stdout

    # A job that fails on the cluster (its input is not there; the config itself is checked before submission):
    # its log, its final state, and its own exit status (2: bad input); `jobs status` exits 1 for it.
    bad = bertpipe("submit", "--", "run", "--config", "tiny", "--workdir", str(tmp_path / "w"), "--set",
                   f"clean.input={tmp_path / 'no_such_dump.xml.bz2'}", env=env, cwd=tmp_path)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "no_such_dump.xml.bz2" in bad.stdout and "bertpipe: error: " in bad.stdout, bad.stdout
    failed = re.search(r"^\[bertpipe\] job (\S+) FAILED after", bad.stdout, re.M)
    assert failed, bad.stdout
    status = bertpipe("jobs", "status", failed.group(1), env=env, cwd=tmp_path)
    assert status.returncode == 1 and status.stdout.startswith(f"{failed.group(1)}: FAILED"), status.stdout

    # --wait, the old spelling of the default, is still accepted.
    old = bertpipe("submit", "--wait", "--", "--version", env=env, cwd=tmp_path)
    assert old.returncode == 0 and "SUCCEEDED" in old.stdout, old.stdout + old.stderr


@pytest.mark.integration
def test_submit_no_wait_returns_at_once_with_the_commands_that_follow_the_job(cluster, tmp_path):
    env = cluster["env"]
    out = bertpipe("submit", "--no-wait", "--address", cluster["dashboard"], "--", "--version", env=env,
                   cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    job = re.search(r"^job:\s+(\S+)$", out.stdout, re.M).group(1)
    assert "following" not in out.stdout and "SUCCEEDED" not in out.stdout
    shown = dict(re.findall(r"^(follow|status|stop):\s+(.+)$", out.stdout, re.M))
    address = ["--address", cluster["dashboard"]]
    assert shlex.split(shown["follow"]) == ["bertpipe", "jobs", "logs", "--follow", job, *address]
    assert shlex.split(shown["status"]) == ["bertpipe", "jobs", "status", job, *address]
    assert shlex.split(shown["stop"]) == ["bertpipe", "jobs", "stop", job, *address]
    followed = bertpipe(*shlex.split(shown["follow"])[1:], env=env, cwd=tmp_path)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert f"bertpipe {importlib.metadata.version('bertpipe')}\n" in followed.stdout
    status = bertpipe(*shlex.split(shown["status"])[1:], env=env, cwd=tmp_path)
    assert status.returncode == 0 and status.stdout.startswith(f"{job}: SUCCEEDED"), status.stdout + status.stderr


# ---------------------------------------------------------------------------------------------------------
# `submit` as `ray job submit` (issue 36, item 2): the uploaded working dir's code runs; the Jobs API options;
# a bad config never reaches the cluster; `jobs status` exits with the job's state.

@pytest.mark.integration
def test_a_change_made_only_in_the_working_dir_runs_on_the_cluster(cluster, tmp_path):
    """A checkout uploaded with --working-dir whose `bertpipe --version` was changed there (and only there): the job
    prints the changed version, not the installed package's. With it: --submission-id, --runtime-env-json's
    env_vars and --entrypoint-num-cpus reach the Jobs API as `ray job submit` sends them."""
    env = cluster["env"]
    wd = tmp_path / "checkout"
    for name in ("jobs", "pipeline", "model", "configs"):
        shutil.copytree(REPO / name, wd / name, ignore=shutil.ignore_patterns("__pycache__"))
    cli_py = wd / "jobs" / "cli.py"
    text = cli_py.read_text()
    installed = '        return version("bertpipe")\n'
    assert installed in text
    cli_py.write_text(text.replace(installed, '        return "0.0.0+from-the-working-dir"\n'))
    job_id = f"bertpipe-wd-{os.getpid()}"
    out = bertpipe("submit", "--working-dir", str(wd), "--submission-id", job_id, "--entrypoint-num-cpus", "1",
                   "--runtime-env-json", '{"env_vars": {"BERTPIPE_E2E_MARK": "36"}}', "--", "--version",
                   env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bertpipe 0.0.0+from-the-working-dir\n" in out.stdout, out.stdout
    assert f"bertpipe {importlib.metadata.version('bertpipe')}\n" not in out.stdout
    assert re.search(rf"^job:\s+{job_id}$", out.stdout, re.M)
    # What the Jobs API holds, asked with Ray's own client (its own process: Ray reads the auth mode once per process).
    ask = ("import json, sys; from ray.job_submission import JobSubmissionClient as C; "
           "i = C().get_job_info(sys.argv[1]); print(json.dumps([str(i.status), i.runtime_env]))")
    asked = subprocess.run([sys.executable, "-c", ask, job_id], env=env, capture_output=True, text=True, timeout=120)
    assert asked.returncode == 0, asked.stderr
    _, runtime_env = json.loads(asked.stdout.strip().splitlines()[-1])
    assert runtime_env["env_vars"]["BERTPIPE_E2E_MARK"] == "36"
    assert runtime_env["working_dir"].startswith("gcs://") and len(runtime_env["py_modules"]) == 1
    # --entrypoint-num-cpus reaches the scheduler (the Jobs API does not echo it): a driver asking for more CPUs
    # than the cluster has (4) waits, PENDING, until stopped.
    big = bertpipe("submit", "--no-wait", "--entrypoint-num-cpus", "64", "--", "--version", env=env, cwd=tmp_path)
    assert big.returncode == 0, big.stdout + big.stderr
    waiting = re.search(r"^job:\s+(\S+)$", big.stdout, re.M).group(1)
    time.sleep(5)
    pending = bertpipe("jobs", "status", waiting, env=env, cwd=tmp_path)
    assert pending.returncode == 3 and pending.stdout.startswith(f"{waiting}: PENDING"), pending.stdout
    assert bertpipe("jobs", "stop", waiting, env=env, cwd=tmp_path).returncode == 0
    # The job id is taken: a second submission under it is refused by the cluster (as `ray job submit` is).
    again = bertpipe("submit", "--job-id", job_id, "--no-wait", "--", "--version", env=env, cwd=tmp_path)
    assert again.returncode == 2 and len(again.stderr.splitlines()) == 1, again.stderr
    assert "already exists" in again.stderr


@pytest.mark.integration
def test_a_bad_config_is_refused_before_anything_is_submitted(cluster, tmp_path):
    env = cluster["env"]
    before = bertpipe("jobs", "list", env=env, cwd=tmp_path)
    for bad in (["--config", "no_such_preset"], ["--config", "tiny", "--set", "pairs.dupe_factr=3"]):
        out = bertpipe("submit", "--", "run", *bad, env=env, cwd=tmp_path)
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
        assert out.stderr.startswith("bertpipe: error: ") and out.stdout == ""
    after = bertpipe("jobs", "list", env=env, cwd=tmp_path)
    assert after.returncode == 0 and after.stdout == before.stdout


@pytest.mark.integration
def test_jobs_status_exits_with_the_jobs_state(cluster, tmp_path, enwiki_sample):
    env = cluster["env"]
    unknown = bertpipe("jobs", "status", "raysubmit_no_such_job", env=env, cwd=tmp_path)
    assert unknown.returncode == 2 and len(unknown.stderr.splitlines()) == 1, unknown.stderr
    assert "no job 'raysubmit_no_such_job'" in unknown.stderr
    # A whole run takes minutes: running (3) while it does, stopped (4) once stopped.
    out = bertpipe("submit", "--no-wait", "--", "run", "--config", "tiny", "--workdir", str(tmp_path / "w"),
                   "--set", f"clean.input={enwiki_sample}", env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    job = re.search(r"^job:\s+(\S+)$", out.stdout, re.M).group(1)
    running = bertpipe("jobs", "status", job, env=env, cwd=tmp_path)
    assert running.returncode == 3 and re.match(rf"{job}: (PENDING|RUNNING)", running.stdout), running.stdout
    assert bertpipe("jobs", "stop", job, env=env, cwd=tmp_path).returncode == 0
    wait_until(lambda: bertpipe("jobs", "status", job, env=env, cwd=tmp_path).returncode != 3, "end of the stopped job",
               poll_s=1)
    status = bertpipe("jobs", "status", job, env=env, cwd=tmp_path)
    assert status.returncode == 4 and status.stdout.startswith(f"{job}: STOPPED"), status.stdout


# ---------------------------------------------------------------------------------------------------------
# A resubmitted job resumes (issue 31, item 4): what the RayJob's backoffLimit does after its driver died


@pytest.mark.integration
@pytest.mark.slow
def test_a_job_whose_driver_was_killed_resumes_from_its_checkpoint_when_submitted_again(cluster, tmp_path):
    import psutil

    from pretrain_helpers import make_inputs

    env = cluster["env"]
    make_inputs(tmp_path / "inputs", lengths=(32,), rows_per_shard=400, num_shards=2, heldout_rows=160)
    (tmp_path / "inputs" / "pairs" / "_MANIFEST.json").unlink()
    phase = ("[{max_seq_length: 32, max_predictions_per_seq: 5, global_batch_size: 16, micro_batch_size: 8,"
             " learning_rate: 1.0e-3, warmup_steps: 2}]")
    workdir = tmp_path / "w"
    command = ["run", "--workdir", str(workdir), "--only", "pretrain", "--set", "mlflow.tracking_uri='off'",
               "--set", f"pretrain.input={tmp_path / 'inputs' / 'pairs'}",
               "--set", f"vocab.path={tmp_path / 'inputs' / 'vocab' / 'vocab.txt'}",
               "--set", f"pretrain.phases={phase}",
               "--set", "pretrain.max_steps=100", "--set", "pretrain.checkpoint_every_steps=20",
               "--set", "pretrain.eval_every_steps=0"]
    first = bertpipe("submit", "--no-wait", "--", *command, env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    wait_until(lambda: list((workdir / "ray_results").rglob("checkpoint_*/position.json")), "checkpoint")
    drivers = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and "run" in p.info["cmdline"]
               and str(workdir) in p.info["cmdline"] and "submit" not in p.info["cmdline"]]
    assert drivers, "the job's driver process was not found"
    for p in drivers:
        p.kill()  # the driver dies as an OOM kill or an evicted head pod would end it
    job = re.search(r"^job:\s+(\S+)$", first.stdout, re.M).group(1)
    wait_until(lambda: bertpipe("jobs", "status", job, env=env, cwd=tmp_path).returncode != 3,  # 3: running
               "end of the first job", poll_s=1)
    again = bertpipe("submit", "--", *command, env=env, cwd=tmp_path, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    metrics = json.loads((workdir / "pretrain" / "metrics.json").read_text())
    assert metrics["step"] == 100 and metrics["resumed_from_step"] >= 20, metrics
    print(f"\nresubmitted job resumed from step {metrics['resumed_from_step']:.0f}")
