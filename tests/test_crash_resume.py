"""A run killed outright never blocks the next one (issue 31): `kill -9` of the whole `bertpipe run` process tree
(the driver, its local Ray and every worker) at points of each stage, then the same command again: it finishes
with exit 0, redoes or resumes what the killed run left (pretrain from its last complete checkpoint, finished
fine-tuning trials reused), the committed result equals an uninterrupted run's where the stage is deterministic,
and a user's file is never deleted. Each point is hit from outside, at a file's appearance: no hook in the product.

The rule under test (pipeline/framework/outputs.py): the run record announces the stage's output names before the run
writes; a file matching them in a folder a killed run left is that run's. The names are checked against what real runs
write (the first hour's `make run`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bertpipe.jobs.pretrain.checkpointing.folders import STATE_FILE
from bertpipe.jobs.workflow import STAGES
from bertpipe.pipeline.framework import outputs
from bertpipe.pipeline.framework.outputs import ForeignFilesError
from bertpipe.pipeline.framework.stage import BOOKKEEPING, read_manifest
import test_faults
from test_faults import BIN, QUIET, cli_env, copy_of, ray_processes
from waiting import wait_until

# test_faults' fixtures: the sample, clean + vocab committed once, a short RAY_TMPDIR per test
home, committed, ray_tmp = test_faults.home, test_faults.committed, test_faults.ray_tmp

OFF = ["--set", "mlflow.tracking_uri='off'"]


# ------------------------------------------------------------------------------------------------------------------
# The rule, on real files


def test_a_killed_runs_announced_files_are_its_own_and_anything_else_still_stops_the_next_run(tmp_path):
    stage = tmp_path / "pairs"
    stage.mkdir()
    outputs.claim(str(stage), "pairs", writes=("seq*/*.parquet", "_parts/seq*/*.arrow"))
    record = json.loads((stage / "_RUN.json").read_text())
    assert record["writes"] == ["_parts/seq*/*.arrow", "seq*/*.parquet"] and record["files"] == []
    # what the run wrote before it was killed (no failure record: SIGKILL runs nothing)
    for rel in ("seq128/train-00000.parquet", "_parts/seq128/heldout-ab12.arrow", "seq512/x.parquet.0a1b2c3d4e5f.tmp"):
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage / rel).write_bytes(b"x")
    assert outputs._survey(str(stage))[1] == []
    # the next run deletes them, redoes the work, and announces the same names again
    outputs.claim(str(stage), "pairs", writes=("seq*/*.parquet", "_parts/seq*/*.arrow"))
    assert sorted(p.name for p in stage.rglob("*") if p.is_file()) == ["_RUN.json"]

    # a user's file that matches no announced name stops the run, and nothing is deleted
    (stage / "seq128").mkdir()
    (stage / "seq128" / "train-00001.parquet").write_bytes(b"run's")
    (stage / "NOTES.md").write_text("mine")
    with pytest.raises(ForeignFilesError, match="NOTES.md"):
        outputs.claim(str(stage), "pairs", writes=("seq*/*.parquet",))
    assert (stage / "NOTES.md").read_text() == "mine" and (stage / "seq128" / "train-00001.parquet").exists()


def test_the_announced_names_cover_every_file_a_real_run_commits(made_run):
    """The first hour's `make run` (clean → vocab → pairs → pretrain → glue): every file each stage committed
    is one of the names the stage announces, or a killed run of it would leave a file the next run refuses."""
    assert made_run["rc"] == 0
    workdir = made_run["workdir"]
    for stage in STAGES:
        manifest = read_manifest(str(workdir / stage.name))
        if manifest is None:
            continue
        unannounced = [f["path"] for f in manifest["files"]
                       if f["path"] not in BOOKKEEPING and not outputs.matches(f["path"], stage.writes)]
        assert not unannounced, (stage.name, unannounced)


# ------------------------------------------------------------------------------------------------------------------
# kill -9 of the whole process tree, then the same command


def start(home: Path, args: list[str], ray_tmp: Path) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "bertpipe"), "run", *args, *QUIET, *OFF], cwd=home, env=cli_env(ray_tmp),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def kill_tree(proc: subprocess.Popen, ray_tmp: Path) -> None:
    """SIGKILL to the driver's process group and to every process of its local Ray (Ray starts some in sessions
    of their own): nothing of the run survives to clean up."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in ray_processes(ray_tmp):
        with contextlib.suppress(Exception):
            p.kill()
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while ray_processes(ray_tmp) and time.monotonic() < deadline:
        time.sleep(0.2)


def kill_when(proc: subprocess.Popen, ray_tmp: Path, appeared) -> None:
    wait_until(appeared, "kill point", still_running=lambda: proc.poll() is None,
               why_stopped=lambda: proc.communicate()[0][-3000:], poll_s=0.05)
    kill_tree(proc, ray_tmp)


def rerun(home: Path, args: list[str], ray_tmp: Path) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([str(BIN / "bertpipe"), "run", *args, *QUIET, *OFF], cwd=home, env=cli_env(ray_tmp),
                          capture_output=True, text=True, timeout=600)
    return done, time.monotonic() - started


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every committed data file (not the bookkeeping, which records times)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in BOOKKEEPING}


@pytest.mark.integration
def test_kill_9_mid_clean_then_the_same_command_commits_what_an_uninterrupted_run_does(committed, home, tmp_path,
                                                                                       ray_tmp):
    workdir = tmp_path / "w"
    workdir.mkdir()
    (workdir / "README-mine.txt").write_text("a user's file in the workdir")
    args = ["--workdir", str(workdir), "--only", "clean"]
    proc = start(home, args, ray_tmp)
    kill_when(proc, ray_tmp, lambda: any((workdir / "clean").glob("docs-*")))
    assert read_manifest(str(workdir / "clean")) is None
    done, seconds = rerun(home, args, ray_tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert digests(workdir / "clean") == digests(committed / "clean")  # deterministic: the same bytes
    assert (workdir / "README-mine.txt").read_text() == "a user's file in the workdir"
    print(f"\nclean killed at its first file; rerun finished in {seconds:.1f} s")


@pytest.mark.integration
@pytest.mark.slow
def test_kill_9_mid_pairs_shard_then_the_same_command_commits_what_an_uninterrupted_run_does(committed, home,
                                                                                              tmp_path, ray_tmp):
    reference = copy_of(committed, tmp_path / "ref")
    done, _ = rerun(home, ["--workdir", str(reference), "--only", "pairs"], ray_tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    workdir = copy_of(committed, tmp_path / "w")
    args = ["--workdir", str(workdir), "--only", "pairs"]
    proc = start(home, args, ray_tmp)
    kill_when(proc, ray_tmp, lambda: any(p.is_file() for p in (workdir / "pairs" / "_parts").rglob("*")))
    done, seconds = rerun(home, args, ray_tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert digests(workdir / "pairs") == digests(reference / "pairs")
    print(f"\npairs killed at its first part file; rerun finished in {seconds:.1f} s")


# Long enough that each kill point comes well before the end (a checkpoint every 20 steps), short enough that the
# rerun's steps after the resume point stay a small part of the test.
PRETRAIN_STEPS = 80


def _synthetic_pretrain(tmp_path: Path) -> list[str]:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from pretrain_helpers import make_inputs

    make_inputs(tmp_path / "inputs", lengths=(32,), rows_per_shard=400, num_shards=2, heldout_rows=160)
    (tmp_path / "inputs" / "pairs" / "_MANIFEST.json").unlink()
    phase = ("[{max_seq_length: 32, max_predictions_per_seq: 5, global_batch_size: 16, micro_batch_size: 8,"
             " learning_rate: 1.0e-3, warmup_steps: 2}]")
    return ["--workdir", str(tmp_path / "w"), "--only", "pretrain",
            "--set", f"pretrain.input={tmp_path / 'inputs' / 'pairs'}",
            "--set", f"vocab.path={tmp_path / 'inputs' / 'vocab' / 'vocab.txt'}", "--set", f"pretrain.phases={phase}",
            "--set", f"pretrain.max_steps={PRETRAIN_STEPS}", "--set", "pretrain.checkpoint_every_steps=20",
            "--set", "pretrain.eval_every_steps=0"]


def _steps_of_checkpoints(workdir: Path) -> list[int]:
    steps = []
    for state in (workdir / "ray_results").rglob(f"checkpoint_*/{STATE_FILE}"):
        with contextlib.suppress(ValueError, KeyError, OSError):
            steps.append(int(json.loads(state.read_text())["step"]))
    return sorted(steps)


def test_a_torn_checkpoint_is_passed_over_for_the_previous_complete_one(tmp_path):
    import torch

    from bertpipe.jobs.pretrain.checkpointing.folders import CKPT_TAG, survey
    from bertpipe.jobs.pretrain.config import PretrainConfig

    cfg = PretrainConfig(num_workers=2, zero_stage=1)
    run = tmp_path / "run"
    for step, stamp in ((20, "10-00-00"), (40, "10-01-00"), (60, "10-02-00")):
        ckpt = run / f"checkpoint_2026-11-26_{stamp}.000000"
        (ckpt / CKPT_TAG).mkdir(parents=True)
        (ckpt / STATE_FILE).write_text(json.dumps({"step": step}))
        for rank in range(2):
            shard = ckpt / CKPT_TAG / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            torch.save({"rank": rank, "w": torch.zeros(1000)}, shard)
        torch.save({"module": torch.zeros(10)}, ckpt / CKPT_TAG / "mp_rank_00_model_states.pt")  # rank 0's
    assert survey(str(tmp_path), "run", cfg) == (str(run / "checkpoint_2026-11-26_10-02-00.000000"), [])
    newest = run / "checkpoint_2026-11-26_10-02-00.000000" / CKPT_TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    newest.write_bytes(newest.read_bytes()[:-200])  # cut short, as a crash mid-upload leaves it
    (run / "checkpoint_2026-11-26_10-01-00.000000" / CKPT_TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    best, torn = survey(str(tmp_path), "run", cfg)
    assert best == str(run / "checkpoint_2026-11-26_10-00-00.000000")
    assert torn == [str(run / f"checkpoint_2026-11-26_{stamp}.000000") for stamp in ("10-01-00", "10-02-00")]


SLOW = pytest.mark.slow  # about a minute on 2 cores: the default suite keeps "right after a checkpoint, torn"
TORN = "right after a checkpoint, torn"


@pytest.mark.integration
@pytest.mark.parametrize("point", [TORN, pytest.param("during the export", marks=SLOW)])
def test_kill_9_during_pretraining_resumes_from_the_last_complete_checkpoint(tmp_path, ray_tmp, point):
    """The resume point is the newest complete checkpoint a kill -9 left. Right after a checkpoint, the newest one is
    also torn (its rank-1 file cut short, as a crash mid-upload leaves it): the rerun says so and resumes from the
    one before (that an untorn newest one is taken: test_a_torn_checkpoint_is_passed_over_for_the_previous_...)."""
    args = _synthetic_pretrain(tmp_path)
    workdir = tmp_path / "w"
    proc = start(tmp_path, args, ray_tmp)
    if point == TORN:
        kill_when(proc, ray_tmp, lambda: _steps_of_checkpoints(workdir) and _steps_of_checkpoints(workdir)[-1] >= 40)
        newest = sorted(d for d in (workdir / "ray_results").rglob("checkpoint_*") if d.is_dir())[-1]
        for shard in newest.rglob("zero_pp_rank_1_*"):
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        kill_when(proc, ray_tmp, lambda: any((workdir / "pretrain" / "export").glob("*")))
    before = _steps_of_checkpoints(workdir)
    done, seconds = rerun(tmp_path, args, ray_tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    if point == TORN:
        said = [line for line in done.stdout.splitlines() if "the newest checkpoint is incomplete" in line]
        assert len(said) == 1 and "resuming from the step-" in said[0], done.stdout
        before = before[:-1]  # the torn one is no resume point
    metrics = json.loads((workdir / "pretrain" / "metrics.json").read_text())
    assert metrics["step"] == PRETRAIN_STEPS
    resumed = int(metrics["resumed_from_step"])
    # the newest complete checkpoint: the newest one the kill left, or the one before it if the kill tore it
    assert resumed in before and resumed >= max(before) - 20 and resumed >= 20, (before, resumed)
    print(f"\npretrain killed {point}: checkpoints then {before}; resumed from step {resumed}; "
          f"rerun finished in {seconds:.1f} s")


@pytest.mark.integration
@pytest.mark.slow
def test_kill_9_mid_fan_out_reuses_the_finished_trials(tmp_path, ray_tmp):
    from bertpipe.jobs.glue.sample import write_sample
    from tiny_bert import save_tiny_bert

    save_tiny_bert(tmp_path / "bert")
    glue = write_sample(str(tmp_path / "glue"))
    args = ["--workdir", str(tmp_path / "w"), "--only", "glue"]
    for s in (f"glue.init={tmp_path / 'bert'}", f"glue.glue_data_dir={glue}", "glue.tasks=[SST-2,MRPC]",
              "glue.learning_rates=[1e-3,5e-4]", "glue.num_epochs=2", "glue.max_seq_length=32",
              "glue.max_concurrent_trials=1"):
        args += ["--set", s]
    proc = start(tmp_path, args, ray_tmp)
    kill_when(proc, ray_tmp, lambda: any((tmp_path / "w" / "glue" / "_trials").rglob("_DONE.json")))
    finished = len(list((tmp_path / "w" / "glue" / "_trials").rglob("_DONE.json")))
    done, seconds = rerun(tmp_path, args, ray_tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kept = re.search(r"glue: (\d+) finished trial\(s\) kept", done.stdout)
    assert kept and int(kept.group(1)) == finished, done.stdout
    manifest = read_manifest(str(tmp_path / "w" / "glue"))
    assert {t: v["status"] for t, v in manifest["extra"]["tasks"].items()} == {"SST-2": "ok", "MRPC": "ok"}
    print(f"\nglue stage killed after {finished} finished trial(s); rerun reused them and finished in {seconds:.1f} s")
