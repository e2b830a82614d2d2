"""A user's first hour, as the user lives it: a fresh clone, `make run` (the README's first command) on a machine
where DeepSpeed never built its CPU op, then the README's follow-up commands in a clean shell (no venv on PATH).

The clone and its `make run` are conftest's `clone` and `made_run` (tests/made_run.py says how they are made:
offline, with DeepSpeed's JIT cache an empty folder, as on a new machine).

Checked on that one run: the console (at most 80 lines, never silent for more than 15 s, no DeepSpeed op compiled,
each stage's summary in its own unit, where everything is at the end), and the commands the README and the end of
the run print, run as printed in a shell without the venv: `make status`, `make ui` (serves the run's store on
127.0.0.1, then stopped like Ctrl-C does), `. .venv/bin/activate` then `bertpipe`, the printed `.venv/bin/mlflow ui
...` and its run URL. (How close the pre-training ETA comes to the truth depends on the machine:
benchmarks/bench_eta.py measures it; its arithmetic is tests/test_eta.py's, on a fake clock.)
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from made_run import REPO, clean_env

pytestmark = pytest.mark.integration

STAGES = ["clean", "vocab", "pairs", "pretrain", "glue"]
UNITS = {"clean": "documents", "vocab": "vocabulary entries", "pairs": "instances", "pretrain": "steps",
         "glue": "trials"}
MAX_LINES, MAX_SILENCE_S = 80, 15.0


@pytest.fixture(scope="module")
def run_ok(made_run):
    text = "\n".join(l for _, _, l in made_run["lines"])
    assert made_run["rc"] == 0, text[-6000:]
    return made_run


def _line(run: dict, prefix: str) -> str:
    found = [l for l in run["stdout"] if l.startswith(prefix)]
    assert found, f"no line starting {prefix!r}:\n" + "\n".join(run["stdout"])
    return found[-1]


# -- item 2: no silent minute ------------------------------------------------------------------------------------


def test_console_of_make_run_is_short_and_never_silent(run_ok):
    times = [0.0] + [t for t, _, _ in run_ok["lines"]] + [run_ok["ended"]]
    gaps = [(b - a, i) for i, (a, b) in enumerate(zip(times, times[1:]))]
    longest, where = max(gaps)
    listing = "\n".join(f"{t:7.1f} {l}" for t, _, l in run_ok["lines"])
    print(f"make run: {len(run_ok['lines'])} console lines, longest silence {longest:.1f} s, {run_ok['ended']:.0f} s")
    assert len(run_ok["lines"]) <= MAX_LINES, listing
    assert longest <= MAX_SILENCE_S, f"{longest:.1f} s of silence before line {where}:\n{listing}"


def test_a_new_machine_compiles_no_deepspeed_op(run_ok):
    """The run needs no C++ op of DeepSpeed: its JIT cache folder, empty at the start, is still empty at the end
    (its CPU communication op, built before on every new machine in 50-90 s, serves inference only)."""
    assert run_ok["ops_built"] == [], run_ok["ops_built"]
    assert not any("DeepSpeed op" in l or "communication op" in l for l in run_ok["stdout"])


def test_each_stage_summary_uses_its_own_unit(run_ok):
    for stage, unit in UNITS.items():
        assert re.fullmatch(rf"  {stage} done: [\d,]+ {unit} in [\d.]+ s", _line(run_ok, f"  {stage} done: "))
        assert re.fullmatch(rf"{stage} +ran +[\d,]+ {unit}  [\d.]+ s", _line(run_ok, f"{stage} "))
    assert not any(" rows" in l for l in run_ok["stdout"]), "\n".join(run_ok["stdout"])


# -- item 3: the end of the run ----------------------------------------------------------------------------------


def test_the_end_says_where_everything_is_and_what_to_do_next(run_ok):
    import mlflow

    from bertpipe.jobs.cli import build_parser

    clone, stdout = run_ok["clone"], run_ok["stdout"]
    end = stdout[stdout.index("Where everything is"):]
    model = next(l for l in end if l.startswith("  model "))
    export = model.split()[1]
    assert (clone / export / "model.safetensors").is_file(), model
    name, version = re.search(r"MLflow registered model (\S+) version (\d+)", model).groups()
    client = mlflow.MlflowClient(f"sqlite:///{run_ok['workdir'] / 'mlflow.db'}")
    assert client.get_model_version(name, version).name == "bertpipe-tiny"
    glue = next(l for l in end if l.startswith("  GLUE "))
    report, zipped = re.search(r"GLUE +(\S+summary\.md) · submission (\S+\.zip)", glue).groups()
    assert (clone / report).is_file() and (clone / zipped).is_file(), glue
    assert "(smoke sample, NOT GLUE)" in glue
    # Next to the scores too: the console's GLUE lines say where they come from.
    scores = _line(run_ok, "GLUE dev")
    assert scores.startswith("GLUE dev (smoke sample, NOT GLUE): CoLA ") and _line(run_ok, "GLUE score ")
    ui = next(l for l in end if l.startswith("  MLflow "))
    assert re.search(r"  MLflow   \.venv/bin/mlflow ui --backend-store-uri sqlite:///\S+/work/tiny/mlflow\.db "
                     r"--port 5000, then http://127\.0\.0\.1:5000/#/experiments/\d+/runs/[0-9a-f]{32}$", ui), ui
    run_id = ui.rsplit("/", 1)[-1]
    assert client.get_run(run_id).data.tags["bertpipe.kind"] == "workflow"
    nxt = next(l for l in end if l.startswith("  next "))
    command = shlex.split(nxt.split("on real GLUE: ", 1)[1].split("  (")[0])
    assert command[0] == ".venv/bin/bertpipe" and (clone / command[0]).is_file(), nxt
    args = build_parser().parse_args(command[1:])
    assert args.command == "run" and "glue.glue_data_dir=GLUE_DIR" in args.overrides


# -- item 1: the README's follow-up commands, in a clean shell ----------------------------------------------------


def readme_follow_up() -> list[str]:
    """The README's second bash block: what it tells a user to type after `make run` (comments dropped)."""
    blocks, block, lang = [], [], None
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, block = line[3:].strip(), []
            else:
                blocks.append((lang, block))
                lang = None
        elif lang is not None:
            block.append(line.split(" #", 1)[0].strip())
    bash = [b for lang, b in blocks if lang == "bash"]
    return [c for c in bash[1] if c]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 60) -> tuple[int, bytes]:
    # A generous read timeout: on a loaded machine the server's first API call (its store opening the SQLite file,
    # lazy imports) took over 5 s in CI; a server that never answers still fails, a minute later.
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, b""


def serve_and_stop(command: str, cwd: Path, env: dict, port: int, run_id: str) -> None:
    """Start a long-running UI command in its own process group, ask it over HTTP on 127.0.0.1:port for the run's
    experiment and the workflow run, then stop it as Ctrl-C does (SIGINT to the group) and see the port free."""
    proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        # Listening first, then asked with _get's own patience: a short read timeout per try let a server that was
        # up but slow to serve its first page under CI's load be asked again and again, never waited for.
        deadline, listening = time.monotonic() + 180, False
        while time.monotonic() < deadline and proc.poll() is None and not listening:
            with socket.socket() as s:
                listening = s.connect_ex(("127.0.0.1", port)) == 0
            if not listening:
                time.sleep(0.5)
        assert listening, f"{command}: nothing listens on {base} (exit {proc.poll()})"
        status, _ = _get(base + "/")
        assert status == 200, f"{command}: {base} answered {status}"
        code, body = _get(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=bertpipe")
        assert code == 200 and json.loads(body)["experiment"]["name"] == "bertpipe"
        code, body = _get(f"{base}/api/2.0/mlflow/runs/get?run_id={run_id}")
        assert code == 200 and json.loads(body)["run"]["info"]["run_id"] == run_id
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground process group
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                pytest.fail(f"{command} did not stop on Ctrl-C")
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, f"{command} still serves {base} after Ctrl-C"


def _workflow_run_id(run: dict) -> str:
    return _line(run, "  MLflow ").rsplit("/", 1)[-1]


def test_readme_shows_the_follow_up_commands():
    assert readme_follow_up()[:3] == ["make status", "make ui", ". .venv/bin/activate"], readme_follow_up()


def test_readme_follow_up_commands_work_in_a_clean_shell(run_ok):
    commands = readme_follow_up()
    assert commands, "the README shows no commands after make run"
    clone, env = run_ok["clone"], run_ok["env"]
    assert shutil.which("bertpipe", path=env["PATH"]) is None and shutil.which("mlflow", path=env["PATH"]) is None
    script = []
    for command in commands:
        if command == "make ui":  # a server: started, asked, stopped
            port = _free_port()
            serve_and_stop(f"make ui UI_PORT={port}", clone, env, port, _workflow_run_id(run_ok))
        else:
            script.append(command)
    # The rest in one shell, in order (`. .venv/bin/activate` holds for the lines after it), stopping at a failure.
    done = subprocess.run(["bash", "-e", "-c", "\n".join(script)], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    states = re.findall(r"^(clean|vocab|pairs|pretrain|glue) +(\w+)", done.stdout, re.M)
    # make status, then bertpipe status: every stage fresh, twice
    assert states == [(s, "fresh") for s in STAGES] * 2, done.stdout


def test_the_printed_mlflow_command_serves_the_printed_run_url(run_ok):
    line = _line(run_ok, "  MLflow ")
    command, url = re.fullmatch(r"  MLflow   (.+), then (http://\S+)", line).groups()
    port = _free_port()
    serve_and_stop(command.replace("--port 5000", f"--port {port}"), run_ok["clone"], run_ok["env"], port,
                   url.rsplit("/", 1)[-1])


def test_make_ui_before_any_run_says_to_run_first(clone):
    proc = subprocess.run(["make", "ui", "WORKDIR=work/none"], cwd=clone, env=clean_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "run make run first" in proc.stderr, proc.stderr
