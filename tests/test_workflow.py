"""The workflow on the real sample through local Ray: stage contract, skips, staleness, MLflow runs, bad input.

Runs the CLI in-process (`jobs.cli.main`) so the session's local Ray is reused.
"""
from __future__ import annotations

import json
import re
import shutil

import pytest

from bertpipe.jobs.cli import main
from bertpipe.pipeline.framework.stage import read_manifest

pytestmark = pytest.mark.integration


def _status(workdir, *overrides):
    from bertpipe.jobs import workflow
    from bertpipe.jobs.config import load_config

    return {r["stage"]: r for r in workflow.status(load_config("tiny", list(overrides), str(workdir)))}


def _run(workdir, *args):
    return main(["run", "--config", "tiny", "--workdir", str(workdir), *args])


@pytest.fixture(scope="module")
def data_workdir(tmp_path_factory, ray_local, enwiki_sample):
    workdir = tmp_path_factory.mktemp("wf")
    assert _run(workdir, "--only", "clean,vocab,pairs", "--set", f"clean.input={enwiki_sample}") == 0
    return workdir


def test_first_run_commits_every_data_stage(data_workdir, enwiki_sample):
    for stage in ("clean", "vocab", "pairs"):
        manifest = read_manifest(str(data_workdir / stage))
        assert manifest is not None and manifest["stage"] == stage
        assert manifest["num_rows"] > 0
        assert manifest["files"], f"{stage} committed no files"
        assert (data_workdir / stage / "_CONFIG.json").is_file()
    clean = read_manifest(str(data_workdir / "clean"))
    assert clean["raw_inputs"][0]["uri"].endswith(enwiki_sample.name)
    assert len(clean["raw_inputs"][0]["checksum"]) >= 32
    # Manifests name their upstream outputs: pairs read exactly the committed clean and vocab outputs.
    pairs = read_manifest(str(data_workdir / "pairs"))
    assert pairs["inputs"] == {"clean": clean["output_id"],
                               "vocab": read_manifest(str(data_workdir / "vocab"))["output_id"]}


def test_second_run_skips_everything_and_changed_pairs_field_reruns_pairs_only(data_workdir, enwiki_sample, capsys):
    inp = f"clean.input={enwiki_sample}"
    before = {s: read_manifest(str(data_workdir / s))["output_id"] for s in ("clean", "vocab", "pairs")}
    capsys.readouterr()
    assert _run(data_workdir, "--only", "clean,vocab,pairs", "--set", inp) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^(clean|vocab|pairs)\s+skipped\b", out, re.M)) == 3, out
    assert {s: read_manifest(str(data_workdir / s))["output_id"] for s in before} == before

    status = _status(data_workdir, inp)
    assert [status[s]["state"] for s in ("clean", "vocab", "pairs")] == ["fresh"] * 3
    assert status["pretrain"]["state"] == "missing"

    changed = "pairs.max_seq_lengths=[128]"
    assert _status(data_workdir, inp, changed)["pairs"]["state"] == "stale"
    assert _run(data_workdir, "--only", "clean,vocab,pairs", "--set", inp, "--set", changed) == 0
    after = {s: read_manifest(str(data_workdir / s))["output_id"] for s in before}
    assert after["clean"] == before["clean"] and after["vocab"] == before["vocab"]
    assert after["pairs"] != before["pairs"]
    assert not (data_workdir / "pairs" / "seq512").exists(), "the rerun must replace the old output, not add to it"
    # Under the original config pairs is now stale again (its committed output was made with [128]).
    assert _status(data_workdir, inp)["pairs"]["state"] == "stale"


def test_mlflow_has_parent_and_nested_stage_runs(data_workdir):
    import mlflow

    client = mlflow.MlflowClient("sqlite:///" + str(data_workdir / "mlflow.db"))
    exp = client.get_experiment_by_name("bertpipe")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get("bertpipe.kind") == "workflow"]
    stages = [r for r in runs if r.data.tags.get("bertpipe.kind") == "stage"]
    assert len(parents) >= 3
    by_parent = {}
    for r in stages:
        by_parent.setdefault(r.data.tags["mlflow.parentRunId"], []).append(r)
    first = min(parents, key=lambda r: r.info.start_time)
    children = {r.data.tags["bertpipe.stage"]: r for r in by_parent[first.info.run_id]}
    assert set(children) == {"clean", "vocab", "pairs"}
    assert children["clean"].data.metrics["num_rows"] > 0
    assert children["pairs"].data.params["pairs.dupe_factor"] == "2"
    assert all(r.info.status == "FINISHED" for r in children.values())
    # A figure the stage logged itself is not logged a second time by the workflow.
    clean_id = children["clean"].info.run_id
    assert len(client.get_metric_history(clean_id, "articles")) == 1
    assert len(client.get_metric_history(clean_id, "num_rows")) == 1
    second = sorted(parents, key=lambda r: r.info.start_time)[1]
    skipped = by_parent[second.info.run_id]
    assert {r.data.tags.get("bertpipe.skipped") for r in skipped} == {"fresh"}


def test_pairs_run_holds_its_first_instances_decoded(data_workdir):
    """The pairs stage's MLflow run has its first instances as text (pipeline/stages/pairs.py show_instances), the same
    text as its folder's copy: the first rows of its first shard, decoded."""
    import mlflow

    from bertpipe.pipeline.stages.pairs import SAMPLE_FILE

    client = mlflow.MlflowClient("sqlite:///" + str(data_workdir / "mlflow.db"))
    exp = client.get_experiment_by_name("bertpipe")
    pairs = [r for r in client.search_runs([exp.experiment_id], max_results=100)
             if r.data.tags.get("bertpipe.stage") == "pairs" and not r.data.tags.get("bertpipe.skipped")]
    run_id = min(pairs, key=lambda r: r.info.start_time).info.run_id
    local = client.download_artifacts(run_id, SAMPLE_FILE, str(data_workdir / "downloaded"))
    text = (data_workdir / "pairs" / SAMPLE_FILE).read_text()
    assert open(local).read() == text and text.count("*** Example ***") == 5
    assert "tokens: [CLS] " in text and "is_random_next: " in text and "\nA: " in text


def test_bad_dump_commits_nothing_and_rerun_after_fix_succeeds(tmp_path, ray_local, sample_dumps, capsys):
    table_dump = sample_dumps["enwiki-table-markup.xml.bz2"]
    broken = tmp_path / "broken.xml.bz2"
    broken.write_bytes(table_dump.read_bytes()[: table_dump.stat().st_size // 2])
    workdir = tmp_path / "w"
    assert _run(workdir, "--only", "clean", "--set", f"clean.input={broken}",
                "--set", "clean.min_article_chars=1") == 2
    err = capsys.readouterr().err
    assert "broken.xml.bz2" in err
    assert read_manifest(str(workdir / "clean")) is None
    assert _status(workdir, f"clean.input={broken}")["clean"]["state"] == "missing"
    shutil.copy(table_dump, broken)  # the "fix": a complete download under the same name
    assert _run(workdir, "--only", "clean", "--set", f"clean.input={broken}",
                "--set", "clean.min_article_chars=1") == 0
    manifest = read_manifest(str(workdir / "clean"))
    assert manifest is not None and manifest["num_rows"] > 0


def test_only_a_stage_without_its_inputs_is_refused(tmp_path, capsys):
    assert _run(tmp_path, "--only", "pairs") == 2
    assert "needs the committed output of clean" in capsys.readouterr().err


def test_status_json_lists_every_stage(tmp_path, capsys):
    assert main(["status", "--config", "tiny", "--workdir", str(tmp_path), "--json",
                 "--set", "clean.input=" + str(tmp_path / "nope.xml.bz2")]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["stage"] for r in rows] == ["clean", "vocab", "pairs", "pretrain", "glue"]
    assert all(r["state"] == "missing" for r in rows)
    assert "nope.xml.bz2" in rows[0]["problem"]
