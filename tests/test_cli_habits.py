"""The CLI's everyday habits (issue 26, item 5), through the installed `bertpipe` command:

`--version`; `--help` that lists the stages and the presets from the code's own lists; `bertpipe config` printing
the resolved config; hints that carry the user's --config / --workdir / --set; a closed stdout that ends quietly;
(a Ray cluster that refuses the token in one line and `submit` following the job like `ray job submit`: in
tests/test_cluster_e2e.py, on its cluster).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bertpipe.jobs import cli, config as config_module, workflow
from bertpipe.jobs.workflow import stages
from bertpipe.pipeline.framework.stage import Stage
from bertpipe.jobs.config import config_as_dict, load_config, preset_names

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BERTPIPE = str(BIN / "bertpipe")


def bertpipe(*args: str, cwd: Path | str = REPO, env: dict | None = None, stdout=subprocess.PIPE,
             timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([BERTPIPE, *args], cwd=cwd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True,
                          timeout=timeout)


def flat(text: str) -> str:
    """argparse wraps help at the terminal's width: one line, single spaces."""
    return " ".join(text.split())


def readme_commands(prefix: str) -> list[str]:
    """The README's shown commands that start with `prefix` (its code blocks; trailing comments dropped)."""
    out, in_block = [], False
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith("```"):
            in_block = not in_block
            continue
        text = line.split(" #", 1)[0].strip()
        if in_block and text.startswith(prefix):
            out.append(text)
    return out


# ---------------------------------------------------------------------------------------------------------
# --version, --help


def test_version_prints_the_installed_package_version():
    for command in ["bertpipe --version", *readme_commands("bertpipe --version")]:
        out = bertpipe(*shlex.split(command)[1:])
        assert out.returncode == 0, out.stderr
        assert out.stdout == f"bertpipe {importlib.metadata.version('bertpipe')}\n"
        assert out.stderr == ""


def test_help_lists_every_stage_and_every_preset():
    presets = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    assert presets and preset_names() == presets
    for name in presets:  # each listed name is one --config resolves
        assert config_module.find_preset(name) == REPO / "configs" / f"{name}.yaml"
    stages = [s.name for s in workflow.STAGES]
    for command in ("run", "status", "config"):
        out = bertpipe(command, "--help")
        assert out.returncode == 0, out.stderr
        text = flat(out.stdout)
        assert f"a preset ({', '.join(presets)}: configs/NAME.yaml) or a YAML file" in text, text
        if command == "run":
            default = [s.name for s in workflow.STAGES if not s.opt_in]
            opt_in = [s.name for s in workflow.STAGES if s.opt_in]
            listed = f"stages: {', '.join(default)}; opt-in: {', '.join(opt_in)}"
            assert text.count(listed) == 2, text  # --only and --from
            assert set(stages) == set(default) | set(opt_in)
    top = bertpipe("--help")
    assert top.returncode == 0 and "--version" in top.stdout and "config" in top.stdout


def test_help_follows_the_codes_lists_not_a_copy_of_them(tmp_path, monkeypatch, capsys):
    """A preset added to configs/ or a stage added to the workflow shows up in --help with no other change."""
    (tmp_path / "huge.yaml").write_text("seed: 1\n")
    (tmp_path / "small.yaml").write_text("seed: 2\n")
    monkeypatch.setattr(config_module, "CONFIG_DIR", tmp_path)
    extra = Stage("distill", lambda: None, ("pretrain",), ("pretrain",), opt_in=True)
    monkeypatch.setattr(stages, "STAGES", (*stages.STAGES, extra))
    with pytest.raises(SystemExit) as done:
        cli.build_parser().parse_args(["run", "--help"])
    assert done.value.code == 0
    text = flat(capsys.readouterr().out)
    assert "a preset (huge, small: configs/NAME.yaml)" in text
    assert re.search(r"opt-in: [\w, ]*\bdistill\b", text)


# ---------------------------------------------------------------------------------------------------------
# bertpipe config


def test_config_prints_the_resolved_config_as_a_preset_it_can_be_run_from(tmp_path):
    overrides = ["pairs.dupe_factor=3", "vocab.input=corpus.txt"]
    argv = ["config", "--config", "tiny", "--workdir", "w1"]
    for item in overrides:
        argv += ["--set", item]
    out = bertpipe(*argv, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    printed = yaml.safe_load(out.stdout)
    expected = load_config("tiny", overrides, "w1", base=str(tmp_path))
    assert printed == config_as_dict(expected)
    # The shape a user writes, every field there, every path as the run resolves it (against the cwd).
    assert list(printed) == list(config_as_dict(load_config("tiny")))
    assert printed["pairs"]["dupe_factor"] == 3
    assert printed["workdir"] == str(tmp_path / "w1")
    assert printed["vocab"]["input"] == str(tmp_path / "corpus.txt")
    assert printed["clean"]["input"] == [str(tmp_path / "data" / "sample" /  # the preset's relative path
                                          "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")]
    # Saved, it is a config file: the same config from anywhere.
    saved = tmp_path / "resolved.yaml"
    saved.write_text(out.stdout)
    assert load_config(str(saved), base="/") == expected


def test_config_command_shown_in_the_readme_runs(tmp_path):
    commands = readme_commands("bertpipe config")
    assert commands, "the README shows `bertpipe config`"
    for command in commands:
        out = bertpipe(*shlex.split(command)[1:], cwd=REPO)
        assert out.returncode == 0, out.stderr
        assert yaml.safe_load(out.stdout)["workdir"].startswith("/")


@pytest.mark.parametrize("bad", ["pairs.dupe_factr=3", "pairs.dupe_factor=three", "nokey"])
def test_config_refuses_a_bad_set_with_the_same_line_as_run(tmp_path, bad):
    shown = bertpipe("config", "--config", "tiny", "--set", bad, cwd=tmp_path)
    run = bertpipe("run", "--config", "tiny", "--workdir", str(tmp_path / "w"), "--set", bad, cwd=tmp_path)
    assert shown.returncode == run.returncode == 2
    assert shown.stdout == ""
    assert shown.stderr == run.stderr
    assert len(shown.stderr.splitlines()) == 1 and shown.stderr.startswith("bertpipe: error: ")
    assert not (tmp_path / "w").exists()


# ---------------------------------------------------------------------------------------------------------
# hints carry the user's config


def _hinted(text: str, sub: str = "run") -> list[list[str]]:
    return [shlex.split(cmd) for cmd in re.findall(rf"`(bertpipe {sub}\b[^`]*)`", text)]


def test_status_hint_carries_config_workdir_and_sets(tmp_path):
    workdir = tmp_path / "my work"
    args = ["--config", "mini", "--workdir", str(workdir), "--set", "pairs.dupe_factor=3"]
    out = bertpipe("status", *args, "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = {r["stage"]: r for r in json.loads(out.stdout)}
    hints = _hinted(rows["vocab"]["problem"])
    assert hints == [["bertpipe", "run", *args, "--from", "clean"]], rows["vocab"]["problem"]
    # The hinted command acts on the config status looked at, not on the tiny preset.
    hinted = cli.build_parser().parse_args(hints[0][1:])
    assert load_config(hinted.config, hinted.overrides, hinted.workdir, base=str(tmp_path)) == \
        load_config("mini", ["pairs.dupe_factor=3"], str(workdir), base=str(tmp_path))
    table = bertpipe("status", *args, cwd=tmp_path)
    assert table.returncode == 0
    assert f"`{shlex.join(['bertpipe', 'run', *args, '--from', 'clean'])}`" in table.stdout


def test_run_refusal_hint_carries_the_config(tmp_path):
    out = bertpipe("run", "--config", "mini", "--workdir", "w", "--only", "vocab", cwd=tmp_path)
    assert out.returncode == 2
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert _hinted(out.stderr) == [["bertpipe", "run", "--config", "mini", "--workdir", "w", "--from", "clean"]]


def test_hint_rewrite_keeps_a_hint_that_names_its_config():
    args = cli.build_parser().parse_args(["status", "--config", "mini"])
    assert cli._with_config("run `bertpipe run --config x --from a`", args) == "run `bertpipe run --config x --from a`"
    assert cli._with_config("`bertpipe run` runs the rest", args) == "`bertpipe run --config mini` runs the rest"
    assert cli._with_config("`bertpipe fetch-sample` first", args) == "`bertpipe fetch-sample` first"


# ---------------------------------------------------------------------------------------------------------
# a closed stdout


def _with_closed_stdout(*args: str, cwd: Path | str = REPO) -> subprocess.CompletedProcess:
    """The command with its stdout a pipe whose reader is already gone: every write fails with EPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        return bertpipe(*args, cwd=cwd, stdout=write)
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [["status", "--json"], ["status"], ["config"], ["--version"], ["run", "--help"]])
def test_closed_stdout_ends_quietly(tmp_path, args):
    if args[0] in ("status", "config"):
        args = [*args, "--config", "tiny", "--workdir", str(tmp_path / "w")]
    out = _with_closed_stdout(*args, cwd=tmp_path)
    # argparse prints --help / --version itself and ignores a failed write (exit 0); the commands end as a unix
    # tool that SIGPIPE killed would (141).
    assert out.returncode == (0 if args[-1].startswith("--") else 141), out.stderr
    assert out.stderr == ""


def test_status_piped_into_head_ends_quietly(tmp_path):
    script = (f"set -o pipefail; {shlex.quote(BERTPIPE)} status --config tiny --workdir {shlex.quote(str(tmp_path))} "
              "--json | head -1")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode in (0, 141), out.stderr
    assert out.stdout == "[\n"
    assert out.stderr == ""


def test_run_with_a_closed_stdout_stops_quietly_and_frees_the_workdir(tmp_path, enwiki_sample):
    workdir = tmp_path / "w"
    args = ["run", "--config", "tiny", "--workdir", str(workdir), "--only", "clean", "--set",
            f"clean.input=[{enwiki_sample}]"]
    for _ in range(2):  # the second one finds the workdir free again (not "in use by another run", exit 2)
        out = _with_closed_stdout(*args, cwd=tmp_path)
        assert out.returncode == 141, out.stderr
        assert out.stderr == ""
    status = bertpipe("status", "--config", "tiny", "--workdir", str(workdir), "--json", cwd=tmp_path)
    assert status.returncode == 0 and json.loads(status.stdout)[0]["state"] == "missing"


def test_a_broken_pipe_that_is_not_stdout_is_still_an_error():
    """Only a closed stdout ends quietly: EPIPE from another pipe or socket (stdout still read) is an error."""
    code = ("import sys; from bertpipe.jobs import cli\n"
            "def dispatch(argv): raise BrokenPipeError(32, 'Broken pipe')\n"
            "cli._dispatch = dispatch\n"
            "sys.exit(cli.main([]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr == "bertpipe: error: [Errno 32] Broken pipe\n"


@pytest.mark.integration
def test_run_whose_reader_goes_away_mid_run_stops_in_three_quiet_lines(tmp_path, enwiki_sample):
    """`bertpipe run | head -3`: the run stops at its next line (as a unix tool would), cleans up, says where it
    stopped and how to resume, without naming a BrokenPipeError; exit 141."""
    workdir = tmp_path / "w"
    args = ["run", "--config", "tiny", "--workdir", str(workdir), "--only", "clean", "--set",
            f"clean.input=[{enwiki_sample}]"]
    proc = subprocess.Popen([BERTPIPE, *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    header = [proc.stdout.readline()]
    while header[-1] and not header[-1].startswith("  log "):  # the header's last line; Ray starts after it
        header.append(proc.stdout.readline())
    assert header[0].startswith("bertpipe run") and header[-1], header
    proc.stdout.close()  # the reader is gone; the run has more to say
    stderr = proc.stderr.read()
    assert proc.wait(timeout=300) == 141, stderr
    lines = stderr.splitlines()
    assert len(lines) == 3, stderr
    assert re.fullmatch(r"bertpipe: (stage clean|run) stopped: standard output was closed", lines[0]), stderr
    assert lines[1].startswith("bertpipe: full log, with the traceback: ")
    assert lines[2].startswith("bertpipe: resume with: bertpipe run --config tiny --workdir ")
    assert "BrokenPipe" not in stderr and "Exception ignored" not in stderr
    again = _with_closed_stdout(*args, cwd=tmp_path)  # the lock was released
    assert again.returncode == 141 and again.stderr == "", again.stderr


def test_following_a_job_stopped_by_ctrl_c_says_how_to_find_it_again(capsys):
    from bertpipe.jobs import submit

    class Client:  # Ctrl-C while the log stream is being read
        def get_job_status(self, job_id):
            return "JobStatus.RUNNING"

        async def tail_job_logs(self, job_id):
            yield "a line\n"
            raise KeyboardInterrupt

    args = cli.build_parser().parse_args(["submit", "--address", "http://h:8265", "--", "run"])
    assert submit._follow(Client(), "raysubmit_1", time.time(), args) == 130
    err = capsys.readouterr().err
    assert "stopped following job raysubmit_1" in err and "it goes on" in err
    assert "bertpipe jobs logs --follow raysubmit_1 --address http://h:8265" in err
    assert "bertpipe jobs stop raysubmit_1 --address http://h:8265" in err


@pytest.mark.parametrize("status,code,expected", [("SUCCEEDED", 0, 0), ("FAILED", 2, 2), ("FAILED", None, 1),
                                                  ("STOPPED", None, 1), ("FAILED", -9, 1)])
def test_submit_exit_status_is_the_jobs_outcome(status, code, expected):
    from types import SimpleNamespace

    from bertpipe.jobs import submit

    assert submit.exit_status(SimpleNamespace(status=f"JobStatus.{status}", driver_exit_code=code)) == expected


# ---------------------------------------------------------------------------------------------------------
# submit checks the command locally; status --check (issue 36, item 2). No cluster runs here: a port nothing
# listens on shows that a refused command never reached one (submitting there is tested in test_cluster_e2e.py).


def _nowhere() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("bad", ["pairs.dupe_factr=3", "pairs.dupe_factor=three", "nokey"])
def test_submit_refuses_a_bad_set_locally_with_the_same_line_as_run(tmp_path, bad):
    run = bertpipe("run", "--config", "tiny", "--workdir", str(tmp_path / "w"), "--set", bad, cwd=tmp_path)
    sub = bertpipe("submit", "--address", _nowhere(), "--", "run", "--config", "tiny", "--workdir",
                   str(tmp_path / "w"), "--set", bad, cwd=tmp_path)
    assert sub.returncode == run.returncode == 2
    assert sub.stderr == run.stderr and len(sub.stderr.splitlines()) == 1, sub.stderr
    assert sub.stdout == ""


def test_submit_checks_preset_file_and_stages_before_it_contacts_the_cluster(tmp_path):
    nowhere = _nowhere()
    unknown = bertpipe("submit", "--address", nowhere, "--", "status", "--config", "no_such_preset", cwd=tmp_path)
    assert unknown.returncode == 2 and unknown.stderr.startswith("bertpipe: error: config 'no_such_preset' not found")
    stage = bertpipe("submit", "--address", nowhere, "--", "run", "--only", "nosuchstage", cwd=tmp_path)
    assert stage.returncode == 2 and len(stage.stderr.splitlines()) == 1 and "nosuchstage" in stage.stderr
    # A relative --config file is looked up in the working dir, where the job will run.
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "mine.yaml").write_text("pairs:\n  dupe_factr: 3\n")
    in_wd = bertpipe("submit", "--address", nowhere, "--working-dir", str(wd), "--", "run", "--config",
                     "mine.yaml", cwd=tmp_path)
    assert in_wd.returncode == 2 and "dupe_factr" in in_wd.stderr, in_wd.stderr
    (wd / "mine.yaml").write_text("pairs:\n  dupe_factor: 3\n")
    good = bertpipe("submit", "--address", nowhere, "--working-dir", str(wd), "--", "run", "--config", "mine.yaml",
                    cwd=tmp_path)  # checked, then the cluster is asked: nobody answers
    assert good.returncode == 2 and "no Ray cluster answers at" in good.stderr, good.stderr
    bad_json = bertpipe("submit", "--address", nowhere, "--runtime-env-json", "[1]", "--", "--version", cwd=tmp_path)
    assert bad_json.returncode == 2 and "--runtime-env-json: expected a JSON object" in bad_json.stderr
    secret = bertpipe("submit", "--address", nowhere, "--runtime-env-json",
                      '{"env_vars": {"AWS_SECRET_ACCESS_KEY": "x"}}', "--", "--version", cwd=tmp_path)
    assert secret.returncode == 2 and "refused" in secret.stderr, secret.stderr


def test_submit_and_jobs_help_say_what_the_code_does():
    sub = flat(bertpipe("submit", "--help").stdout)
    assert "$RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS" in sub
    for flag in ("--submission-id ID, --job-id ID", "--runtime-env-json JSON", "--entrypoint-num-cpus N",
                 "--entrypoint-num-gpus N", "--working-dir"):
        assert flag in sub, flag
    status = flat(bertpipe("jobs", "status", "--help").stdout)
    assert "0 SUCCEEDED, 1 FAILED, 3 PENDING or RUNNING" in status and "4 STOPPED" in status


def test_status_check_exits_with_the_workdirs_state(tmp_path, enwiki_sample):
    from conftest import USER_RUN_SETTINGS

    common = ["--config", "tiny", "--workdir", str(tmp_path / "w"), "--set", f"clean.input={enwiki_sample}",
              *USER_RUN_SETTINGS]
    assert bertpipe("status", *common, cwd=tmp_path).returncode == 0  # a report: 0 whenever it could report
    assert bertpipe("status", *common, "--check", cwd=tmp_path).returncode == 3  # nothing run yet: missing
    ran = bertpipe("run", *common, "--only", "clean", cwd=tmp_path, timeout=600)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert bertpipe("status", *common, "--check", "--json", cwd=tmp_path).returncode == 3  # later stages missing
    rows = json.loads(bertpipe("status", *common, "--json", cwd=tmp_path).stdout)
    clean = next(r for r in rows if r["stage"] == "clean")
    shard = next(Path(clean["output"]).glob("*.parquet"))
    shard.write_bytes(shard.read_bytes() + b"x")  # an output no longer at the size its manifest lists
    broken = bertpipe("status", *common, "--check", cwd=tmp_path)
    assert broken.returncode == 1 and re.search(r"^clean\s+broken", broken.stdout, re.M), broken.stdout
