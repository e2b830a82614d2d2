"""A new user's first run, as the user runs it: conftest's `made_run` (`make run` in a fresh clone, its own local
Ray in a temp dir of its own, so the test can look inside Ray's session folders afterwards), then the `bertpipe`
command again from a directory that is neither the repo nor the workdir, with a relative --workdir.

Covers: every output lands under the workdir and nothing under Ray's folders; a second run from elsewhere only
skips; vocab and pairs run alone from a text file. Elsewhere, each faster than a run of its own here: a stage whose
output is gone is broken and reruns without --force (tests/test_stage_folder.py); pretrain alone from a bare shard
folder and a vocab.txt (tests/test_faults.py::test_sigint_during_pretraining_ends_as_an_interrupt, and
tests/test_pretrain.py on to the export); glue alone from an explicit model
(tests/test_task_failures.py::test_a_failed_glue_task_fails_the_run_and_the_rerun_retries_only_it); a stage that
fails at run time names itself, its log and the resume command
(tests/test_faults.py::test_error_inside_a_ray_data_task_shows_its_cause_only).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import USER_RUN_SETTINGS, user_env

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
STAGES = ["clean", "vocab", "pairs", "pretrain", "glue"]
# Runs after the shared one track nothing, so tests/test_watching.py finds the one workflow run it inspects in
# MLflow (tracking settings are not part of any stage's fingerprint).
UNTRACKED = ["--set", "mlflow.tracking_uri='off'"]
SHORT = [*USER_RUN_SETTINGS, *UNTRACKED]


def bertpipe(cwd: Path, *args: str, ray_tmp: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "bertpipe"), *args], cwd=cwd, env=user_env(ray_tmp), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ray_tmp(made_run):
    return made_run["ray_tmp"]


@pytest.fixture(scope="module")
def first_run(made_run):
    """The whole workflow of `make run` (conftest's, shared)."""
    assert made_run["rc"] == 0, "\n".join(made_run["stdout"][-40:] + made_run["stderr"][-60:])
    return made_run


def _status(cwd: Path, workdir: Path, *extra: str, ray_tmp: Path) -> dict[str, dict]:
    proc = bertpipe(cwd, "status", "--config", "configs/tiny.yaml", "--workdir", str(workdir), "--json", *extra,
                    ray_tmp=ray_tmp, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return {r["stage"]: r for r in json.loads(proc.stdout)}


def test_every_output_is_under_the_workdir_and_nothing_under_ray(first_run, ray_tmp):
    """The workdir is relative (the config's work/tiny): resolved by the driver, never inside a Ray worker, whose
    current directory is Ray's per-run folder."""
    workdir = first_run["workdir"]
    for stage in STAGES:
        manifest = json.loads((workdir / stage / "_MANIFEST.json").read_text())
        for f in manifest["files"]:
            assert (workdir / stage / f["path"]).is_file(), (stage, f["path"])
    export = workdir / "pretrain" / "export"
    assert {"config.json", "model.safetensors", "vocab.txt"} <= {p.name for p in export.iterdir()}
    assert (workdir / "glue" / "summary.md").is_file()
    under_ray = [p for p in ray_tmp.rglob("*") if p.name in ("model.safetensors", "_MANIFEST.json", "summary.md")]
    assert under_ray == [], under_ray


def test_a_second_run_from_elsewhere_with_a_relative_workdir_only_skips(first_run, ray_tmp, tmp_path):
    clone = first_run["clone"]
    sample = clone / "data" / "sample" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    workdir = os.path.relpath(first_run["workdir"], tmp_path)  # the shared workdir, relative to where the user is
    proc = subprocess.run([str(clone / ".venv" / "bin" / "bertpipe"), "run", "--config",
                           str(clone / "configs" / "tiny.yaml"), "--workdir", workdir,
                           "--set", f"clean.input=[{sample}]", *UNTRACKED],
                          cwd=tmp_path, env={**first_run["env"], "RAY_TMPDIR": str(ray_tmp)}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.split()[:2] for line in proc.stdout.splitlines() if line.split()[:1] in ([s] for s in STAGES)] \
        == [[s, "skipped"] for s in STAGES]


def _google_text(clean_dir: Path, out: Path, max_chars: int = 1_500_000) -> Path:
    """The clean output as google-research/bert's text format: one sentence-ish line, blank line between docs; its
    first documents up to `max_chars` (a quarter of the sample: enough for a 2,000-piece vocabulary, and the pairs
    stage's tokenizing stays short)."""
    table = pq.read_table(sorted(clean_dir.glob("*.parquet"))[0], columns=["text"])
    docs, size = [], 0
    for text in filter(None, table.column("text").to_pylist()):
        if size >= max_chars:
            break
        docs.append(text)
        size += len(text)
    out.write_text("\n\n".join(docs) + "\n")
    return out


# Two CLI runs, one with a local Ray. Elsewhere a text file feeds vocab (tests/test_workdir_lock.py), and pairs reads
# the clean stage's Parquet in every workflow test: here pairs reads a text file.
def test_vocab_and_pairs_run_alone_from_text_files(first_run, ray_tmp, tmp_path):
    _google_text(first_run["workdir"] / "clean", tmp_path / "corpus.txt")
    alone = tmp_path / "alone"
    proc = bertpipe(tmp_path, "run", "--workdir", "alone", "--only", "vocab", "--set", "vocab.input=corpus.txt",
                    "--set", "vocab.vocab_size=2000", ray_tmp=ray_tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((alone / "vocab" / "vocab.txt").read_text().splitlines()) > 1000

    vocab = first_run["workdir"] / "vocab" / "vocab.txt"
    proc = bertpipe(tmp_path, "run", "--workdir", "pairs-alone", "--only", "pairs", "--set", "pairs.input=corpus.txt",
                    "--set", f"vocab.path={vocab}", "--set", "pairs.max_seq_lengths=[128]", ray_tmp=ray_tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "pairs-alone" / "pairs" / "_MANIFEST.json").read_text())
    assert manifest["num_rows"] > 100
    assert any(r["uri"] == str(tmp_path / "corpus.txt") and r["checksum"].startswith("sha256:")
               for r in manifest["raw_inputs"])
    # The explicit vocabulary enters the fingerprint by content: another vocab.txt makes pairs stale.
    other = tmp_path / "other-vocab.txt"
    other.write_text(vocab.read_text() + "zzzextra\n")
    base = ["--set", "pairs.input=corpus.txt", "--set", "pairs.max_seq_lengths=[128]"]
    same = _status(tmp_path, tmp_path / "pairs-alone", *base, "--set", f"vocab.path={vocab}", ray_tmp=ray_tmp)
    changed = _status(tmp_path, tmp_path / "pairs-alone", *base, "--set", f"vocab.path={other}", ray_tmp=ray_tmp)
    assert same["pairs"]["state"] == "fresh" and changed["pairs"]["state"] == "stale"

