"""A requested task that fails makes the run fail, and the rerun retries only what failed (issue 24, item 6).

The GLUE case runs the real `bertpipe` CLI in-process (the session's local Ray, a real MLflow SQLite store): a
malformed MRPC row beside a good SST-2 fails the run with the task named in the one-line cause, commits nothing,
and keeps SST-2's finished trial; the printed resume command, after the fix, runs MRPC's trial alone and commits
both tasks. The folder-level rules (what the workdir's cleanup may delete around kept trials) run on real files.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tiny_bert import save_tiny_bert

from bertpipe.jobs.cli import main
from bertpipe.jobs.tuning import kept
from bertpipe.jobs.glue.sample import write_sample
from bertpipe.jobs.tuning.loop import TrialResult
from bertpipe.pipeline.framework import outputs, parts
from bertpipe.pipeline.framework.outputs import ForeignFilesError
from bertpipe.pipeline.framework.stage import read_manifest

PART = "_trials/SST-2/lr=0.001/seed=1"


def _result() -> TrialResult:
    return TrialResult(1e-3, 7, 0.5, {"SST-2.accuracy": 0.5}, 1, [{"train_loss": 0.7}],
                       {"test_predictions": {"SST-2": (["0", "1"], [1, 0])}}, 16, 2, 0.1, 0.05, 160.0)


def _kept_part(stage: Path) -> Path:
    """A committed trial part as the glue stage leaves it: a model file, then the marker."""
    (stage / PART / "model").mkdir(parents=True)
    (stage / PART / "model" / "model.safetensors").write_bytes(b"weights")
    kept.save(str(stage), PART, "key-1", _result())
    return stage / PART


def test_kept_trials_survive_the_workdir_cleanup_and_nothing_else_does(tmp_path):
    stage = tmp_path / "glue"
    stage.mkdir()
    run_id = outputs.claim(str(stage), "glue")  # a run starts, keeps one trial, writes a file, then fails
    part = _kept_part(stage)
    (stage / "smoke_glue").mkdir()
    (stage / "smoke_glue" / "README.txt").write_text("left by the failed run")
    outputs.record_failure(str(stage), run_id)
    record = json.loads((stage / "_RUN.json").read_text())
    assert record["files"] == ["smoke_glue/README.txt"]  # what the next run deletes; the kept trial is not in it
    assert kept.restore(str(stage), PART, "key-1", TrialResult) == TrialResult(
        **{**_result().__dict__,
           "outputs": {"test_predictions": {"SST-2": [["0", "1"], [1, 0]]}}})  # JSON: tuples as lists

    outputs.claim(str(stage), "glue")  # the rerun
    assert sorted(p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file()) == [
        "_RUN.json", f"{PART}/_DONE.json", f"{PART}/model/model.safetensors"]
    # A kept result is reused only under its key and with its files intact.
    assert kept.restore(str(stage), PART, "another-config", TrialResult) is None
    (part / "model" / "model.safetensors").write_bytes(b"truncated")
    assert kept.restore(str(stage), PART, "key-1", TrialResult) is None

    # A file no marker lists, inside a part, is not ours: the run stops and deletes nothing.
    (part / "notes.txt").write_text("mine")
    with pytest.raises(ForeignFilesError, match="notes.txt"):
        outputs.claim(str(stage), "glue")
    (part / "notes.txt").unlink()
    outputs.claim(str(stage), "glue", keep_parts=False)  # --force: recompute everything
    assert not (stage / "_trials").exists() and parts.count(str(stage)) == 0


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert") / "export")


def _trial_runs(tracking_uri: str) -> list[str]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("bertpipe")
    trials = client.search_runs([exp.experiment_id], "tags.`bertpipe.kind` = 'glue_trial'")
    return sorted(r.info.run_name for r in trials)


@pytest.mark.integration
def test_a_failed_glue_task_fails_the_run_and_the_rerun_retries_only_it(ray_local, tiny_bert, tmp_path, capsys):
    glue = Path(write_sample(str(tmp_path / "glue")))
    train = glue / "MRPC" / "train.tsv"
    good = train.read_bytes()
    lines = good.decode("utf-8-sig").split("\n")
    lines[3] = "1\tonly two fields"  # line 4 of the file
    train.write_text("\n".join(lines))
    work, tracking = tmp_path / "w", f"sqlite:///{tmp_path}/w/mlflow.db"
    sets = [f"glue.init={tiny_bert}", f"glue.glue_data_dir={glue}", "glue.tasks=[MRPC,SST-2]",
            "glue.learning_rates=[1e-3]", "glue.num_epochs=1", "glue.max_seq_length=32",
            "glue.max_train_examples=16", f"mlflow.tracking_uri={tracking}"]
    args = ["--workdir", str(work), *[a for s in sets for a in ("--set", s)]]

    assert main(["run", "--only", "glue", *args]) == 2  # bad input: a user error
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3, err  # the stage and its cause, the log file, the resume command: no WARNING lines
    assert err[0].startswith(f"bertpipe: stage glue failed: 1 of 2 requested GLUE tasks failed: MRPC: {train}:4: "
                             "malformed row") and "1 finished trial kept" in err[0]
    assert read_manifest(str(work / "glue")) is None  # nothing calls the stage fresh
    assert (work / "glue" / PART / "_DONE.json").is_file()
    assert _trial_runs(tracking) == ["SST-2-lr0.001-seed1"]
    assert main(["status", "--json", *args]) == 0
    row = {r["stage"]: r for r in json.loads(capsys.readouterr().out)}["glue"]
    assert row["state"] == "missing" and "kept 1 finished trial" in row["problem"]

    train.write_bytes(good)  # the fix; then the command the failure printed
    resume = shlex.split(err[2].split("resume with: ", 1)[1])
    assert main(resume[1:]) == 0
    assert _trial_runs(tracking) == ["MRPC-lr0.001-seed1", "SST-2-lr0.001-seed1"]  # only MRPC's trial ran again
    manifest = read_manifest(str(work / "glue"))
    assert {t: v["status"] for t, v in manifest["extra"]["tasks"].items()} == {"MRPC": "ok", "SST-2": "ok"}
    assert manifest["metrics"]["num_trials_kept"] == 1 and manifest["num_rows"] == 2
    # the explicit initial model is one of the stage's raw inputs: another checkpoint there makes it stale
    assert any(r["uri"].endswith("model.safetensors") for r in manifest["raw_inputs"]), manifest["raw_inputs"]
    assert not any(f["path"].startswith("_trials/") for f in manifest["files"])
    assert sorted(p.name for p in (work / "glue" / "models").iterdir()) == ["MRPC", "SST-2"]
    capsys.readouterr()
    assert main(["status", "--json", *args]) == 0
    assert {r["stage"]: r["state"] for r in json.loads(capsys.readouterr().out)}["glue"] == "fresh"
