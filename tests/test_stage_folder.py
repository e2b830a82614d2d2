"""A stage folder holds what its manifest lists, and a rerun deletes only what runs of the stage wrote.

Fresh means every listed file is there with its recorded size (and, with `status --verify`, its sha256) and no
other file is; anything else makes the stage broken, and an invalid manifest is broken too, never a crash.
Downstream stages read the files the manifest lists, not the folder. A rerun deletes the files the previous
manifest lists, what a failed run recorded, and writers' temporary files; any other file stops the run with one
line and nothing deleted. Real files, the real CLI; the two tests that run stages use the session's local Ray.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bertpipe.jobs import workflow
from bertpipe.jobs.cli import main
from bertpipe.jobs.config import load_config
from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.stages.documents import document_files
from bertpipe.pipeline.framework.outputs import ForeignFilesError, claim, record_failure
from bertpipe.pipeline.framework.stage import StageResult, manifest_state, read_manifest, write_manifest

BIN = Path(sys.executable).parent


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _docs(path: Path, rows: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(rows)), "title": ["t"] * rows, "text": ["Some text."] * rows}), path)


def _commit(out: Path, fingerprint: str = "f", stage: str = "clean", outputs: tuple[str, ...] = ()) -> dict:
    (out / "_CONFIG.json").write_text("{}")
    return write_manifest(str(out), stage=stage, fingerprint=fingerprint, result=StageResult(1, outputs=list(outputs)),
                          config={}, inputs={}, started=time.time(), code_version="test")


# ---------------------------------------------------------------- a rerun deletes only what the stage wrote

def test_run_stops_at_a_file_it_did_not_write_and_deletes_nothing(tmp_path, enwiki_sample):
    folder = tmp_path / "W" / "clean"
    (folder / "sub").mkdir(parents=True)
    (folder / "important.txt").write_text("x")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    proc = subprocess.run([str(BIN / "bertpipe"), "run", "--only", "clean", "--workdir", "W",
                           "--set", f"clean.input={enwiki_sample}"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert str(folder / "important.txt") in lines[0] and "nothing was deleted" in lines[0]
    assert _tree(tmp_path / "W") == ["clean", "clean/important.txt", "clean/sub"]


def test_rerun_deletes_listed_files_and_own_temporaries_only(tmp_path):
    out = tmp_path / "pairs"
    _docs(out / "seq128" / "train-00000.parquet", 3)
    _docs(out / ".hidden-output", 1)  # a stage's hidden file is listed like any other
    _commit(out, stage="pairs", outputs=("seq128/train-00000.parquet",))
    temp = out / "seq128" / storage.temp_path("train-00001.parquet")  # a retried task's leftover
    temp.write_bytes(b"half")
    (out / "empty-by-hand").mkdir()  # nobody's file in it: left where it is

    run_id = claim(str(out), "pairs")

    assert _tree(out) == ["_RUN.json", "empty-by-hand"]  # seq128/ went with the files that emptied it
    record = json.loads((out / "_RUN.json").read_text())
    assert record["run_id"] == run_id and record["stage"] == "pairs" and record["files"] == []


def test_a_foreign_file_stops_the_rerun_before_any_deletion(tmp_path):
    out = tmp_path / "clean"
    _docs(out / "docs-00000-0000.parquet", 2)
    _commit(out)
    (out / "notes.txt").write_text("mine")
    before = _tree(out)
    with pytest.raises(ForeignFilesError, match=r"clean/notes\.txt, which no run of stage clean wrote"):
        claim(str(out), "clean")
    assert _tree(out) == before and read_manifest(str(out)) is not None  # still committed, nothing touched


def test_a_failed_run_records_what_it_left_and_a_killed_one_cannot(tmp_path):
    out = tmp_path / "clean"
    run_id = claim(str(out), "clean")
    _docs(out / "docs-00000-0000.parquet", 2)  # what the run wrote before it failed
    record_failure(str(out), run_id)
    claim(str(out), "clean")  # the next run may delete it: the record says this stage wrote it
    assert _tree(out) == ["_RUN.json"]

    _docs(out / "docs-00000-0000.parquet", 2)  # a run killed outright (SIGKILL) records nothing
    with pytest.raises(ForeignFilesError, match="docs-00000-0000.parquet"):
        claim(str(out), "clean")
    assert (out / "docs-00000-0000.parquet").is_file()


def test_a_manifest_cannot_make_a_rerun_delete_outside_its_folder(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("not the stage's")
    out = tmp_path / "clean"
    out.mkdir()
    (out / "_MANIFEST.json").write_text(json.dumps({"files": [{"path": "../victim.txt", "size": 15}],
                                                    "outputs": [str(victim)]}))
    assert manifest_state(str(out))[0] is None and "schema" in manifest_state(str(out))[1]
    claim(str(out), "clean")
    assert victim.read_text() == "not the stage's"


def test_temporary_names_are_unique_per_write_and_never_listed(tmp_path):
    names = {storage.temp_path(str(tmp_path / "a.parquet")) for _ in range(100)}
    assert len(names) == 100 and all(storage.is_temp(n) for n in names)
    assert not storage.is_temp("a.parquet.tmp")  # a user's .tmp is not ours to delete
    Path(names.pop()).write_bytes(b"x")
    assert storage.list_files(str(tmp_path)) == []


# ---------------------------------------------------------------- fresh = exactly what the manifest lists

@pytest.fixture
def committed_clean(tmp_path, enwiki_sample):
    """A workdir whose clean folder is committed with the fingerprint the workflow expects (so `status` says
    fresh), holding two document files: what a clean run leaves, without running one."""
    overrides = [f"clean.input={enwiki_sample}", "mlflow.tracking_uri=off"]
    cfg = load_config("tiny", overrides, str(tmp_path / "w"))
    fingerprint = workflow.preflight(cfg, ["clean"])["clean"].fingerprint(cfg)
    out = tmp_path / "w" / "clean"
    _docs(out / "docs-00000-0000.parquet", 3)
    _docs(out / "docs-00001-0000.parquet", 4)
    _commit(out, fingerprint=fingerprint)
    return out, ["--workdir", str(tmp_path / "w"), *(a for o in overrides for a in ("--set", o))]


def _clean_state(args: list[str], capsys, *extra: str) -> dict:
    assert main(["status", "--json", *args, *extra]) == 0
    return json.loads(capsys.readouterr().out)[0]


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,problem", [
    (lambda out: shutil.copy(out / "docs-00000-0000.parquet", out / "docs-00002-0000.parquet"),
     "docs-00002-0000.parquet is not in the manifest"),
    (lambda out: (out / "docs-00001-0000.parquet").unlink(), "docs-00001-0000.parquet missing"),
    (lambda out: (out / "docs-00001-0000.parquet").write_bytes(b""), "docs-00001-0000.parquet is 0 bytes"),
    (lambda out: (out / "_MANIFEST.json").write_text("[1, 2]"), "is list, not an object"),
    (lambda out: (out / "_MANIFEST.json").write_text(
        (out / "_MANIFEST.json").read_text().replace('"num_rows": 1', '"num_rows": "1"')),
     "field num_rows is str, expected int"),
    (lambda out: (out / "_MANIFEST.json").write_text('{"stage": "cle'), "is not JSON"),
], ids=["extra", "missing", "resized", "not-an-object", "wrong-type", "torn"])
def test_any_difference_from_the_manifest_is_broken(committed_clean, capsys, damage, problem):
    out, args = committed_clean
    assert _clean_state(args, capsys)["state"] == "fresh"
    damage(out)
    row = _clean_state(args, capsys)
    assert row["state"] == "broken" and problem in row["problem"], row


def test_verify_finds_a_changed_file_of_the_same_size(committed_clean, capsys):
    out, args = committed_clean
    _flip_a_byte(out / "docs-00000-0000.parquet")
    assert _clean_state(args, capsys)["state"] == "fresh"  # sizes only: cheap enough for every run
    row = _clean_state(args, capsys, "--verify")
    assert row["state"] == "broken" and "docs-00000-0000.parquet changed" in row["problem"]


def test_downstream_reads_only_the_listed_files_and_refuses_a_broken_upstream(committed_clean, capsys):
    out, args = committed_clean
    shutil.copy(out / "docs-00000-0000.parquet", out / "docs-00002-0000.parquet")  # copied in after the commit
    assert [Path(f).name for f in document_files(str(out))] == ["docs-00000-0000.parquet", "docs-00001-0000.parquet"]
    assert main(["run", "--only", "pairs", "--force", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs the committed output of clean" in err[0] and "docs-00002-0000.parquet" in err[0]


# ---------------------------------------------------------------- through real stage runs (local Ray)

@pytest.mark.integration
def test_a_failed_run_leaves_a_record_and_the_next_run_cleans_up_after_it(tmp_path, ray_local, sample_dumps,
                                                                           enwiki_sample):
    good, bad = tmp_path / "a.xml.bz2", tmp_path / "b.xml.bz2"
    shutil.copy(sample_dumps["enwiki-table-markup.xml.bz2"], good)
    bad.write_bytes(enwiki_sample.read_bytes()[: enwiki_sample.stat().st_size // 2])  # pages, then cut off
    args = ["run", "--only", "clean", "--workdir", str(tmp_path / "w"), "--set", f"clean.input=[{good},{bad}]",
            "--set", "clean.num_read_workers=1", "--set", "clean.rows_per_file=2", "--set", "mlflow.tracking_uri=off"]
    assert main(args) == 2
    out = tmp_path / "w" / "clean"
    record = json.loads((out / "_RUN.json").read_text())
    left = sorted(p for p in _tree(out) if (out / p).is_file() and p != "_RUN.json")
    assert sorted(record["files"]) == left and "docs-00000-0000.parquet" in left

    shutil.copy(enwiki_sample, bad)  # the fix: the whole dump
    assert main(args) == 0
    manifest = read_manifest(str(out))
    assert sorted(f["path"] for f in manifest["files"]) == sorted(
        p for p in _tree(out) if (out / p).is_file() and p not in ("_MANIFEST.json", "_CONFIG.json"))


@pytest.mark.integration
def test_a_resized_shard_makes_pairs_broken_and_the_workflow_recomputes_only_pairs(tmp_path, ray_local,
                                                                                   enwiki_sample, capsys):
    args = ["--workdir", str(tmp_path / "w"), "--set", f"clean.input={enwiki_sample}", "--set",
            "vocab.vocab_size=2000", "--set", "pairs.max_seq_lengths=[64]", "--set", "pairs.dupe_factor=1",
            "--set", "pairs.num_shards=2", "--set", "mlflow.tracking_uri=off"]
    assert main(["run", "--only", "clean,vocab,pairs", *args]) == 0
    before = {s: read_manifest(str(tmp_path / "w" / s)) for s in ("clean", "vocab", "pairs")}
    (tmp_path / "w" / "pairs" / "seq64" / "train-00001.parquet").write_bytes(b"")
    capsys.readouterr()
    assert main(["status", "--json", *args]) == 0
    assert {r["stage"]: r["state"] for r in json.loads(capsys.readouterr().out)}["pairs"] == "broken"

    assert main(["run", "--only", "clean,vocab,pairs", *args]) == 0
    assert "pairs: rerunning (broken: seq64/train-00001.parquet is 0 bytes" in capsys.readouterr().out
    after = {s: read_manifest(str(tmp_path / "w" / s)) for s in before}
    assert [after[s]["output_id"] == before[s]["output_id"] for s in before] == [True, True, False]
    assert after["pairs"]["files"] == before["pairs"]["files"]  # the same data again, sizes and checksums
