"""Bad input fails fast: one line on stderr, exit 2, before any Ray or MLflow work, and nothing committed.

Each case runs the real `bertpipe` command in a subprocess from an empty directory, as a user would.
"""
from __future__ import annotations

import bz2
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def bertpipe(cwd: Path, *args: str, ray_tmp: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    if ray_tmp is not None:  # where a Ray this command started would keep its session
        env["RAY_TMPDIR"] = str(ray_tmp)
    return subprocess.run([str(BIN / "bertpipe"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def assert_one_line_refusal(proc: subprocess.CompletedProcess, *needles: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("bertpipe: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def no_manifest_under(path: Path) -> bool:
    return not list(path.rglob("_MANIFEST.json"))


@pytest.fixture
def sample_copy(tmp_path, enwiki_sample) -> Path:
    """A run directory with the sample where the tiny preset looks for it (data/sample/ under the cwd)."""
    dest = tmp_path / "data" / "sample" / enwiki_sample.name
    dest.parent.mkdir(parents=True)
    os.symlink(enwiki_sample, dest)
    return tmp_path


def test_invalid_value_is_refused_at_load_before_any_stage(sample_copy):
    proc = bertpipe(sample_copy, "run", "--set", "pretrain.zero_stage=5", ray_tmp=sample_copy / "ray")
    assert_one_line_refusal(proc, "zero_stage must be 0, 1, 2 or 3, got 5")
    assert not (sample_copy / "ray").exists()  # no Ray was started
    assert not (sample_copy / "work").exists()


def test_unknown_key_suggests_the_right_one(sample_copy):
    assert_one_line_refusal(bertpipe(sample_copy, "run", "--set", "pretrain.zero_stag=1"),
                            "unknown config key pretrain.zero_stag", "did you mean pretrain.zero_stage?")
    assert_one_line_refusal(bertpipe(sample_copy, "status", "--set", "glue.learning_rate=[1e-5]"),
                            "did you mean glue.learning_rates?")


def test_missing_dump_hints_at_fetch_sample(tmp_path):
    line = assert_one_line_refusal(bertpipe(tmp_path, "run"), "does not exist", "bertpipe fetch-sample")
    assert str(tmp_path / "data" / "sample") in line  # the relative default, resolved where the user ran it
    assert no_manifest_under(tmp_path)


def test_finetune_init_must_be_a_bert_checkpoint(tmp_path):
    assert_one_line_refusal(bertpipe(tmp_path, "run", "--only", "glue", "--set", "glue.init=nowhere"),
                            f"glue.init {tmp_path / 'nowhere'} does not exist")
    not_bert = tmp_path / "gpt"
    not_bert.mkdir()
    (not_bert / "config.json").write_text('{"model_type": "gpt2", "n_embd": 768}')
    assert_one_line_refusal(bertpipe(tmp_path, "run", "--only", "glue", "--set", "glue.init=gpt"),
                            "is not a BERT checkpoint")
    assert no_manifest_under(tmp_path)


def _tiny_checkpoint(folder: Path) -> Path:
    from bertpipe.model import BertConfig, BertForPreTraining, save_pretrained

    vocab = folder.parent / "vocab-src.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(59)]) + "\n")
    save_pretrained(BertForPreTraining(BertConfig.preset("tiny", vocab_size=64)), folder, vocab)
    return folder


def test_glue_folder_lacking_a_requested_task_file_is_refused(tmp_path):
    init = _tiny_checkpoint(tmp_path / "ckpt")
    glue = tmp_path / "glue" / "MRPC"
    glue.mkdir(parents=True)
    (glue / "train.tsv").write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\ta b\tc d\n")
    proc = bertpipe(tmp_path, "run", "--only", "glue", "--set", f"glue.init={init}",
                    "--set", "glue.glue_data_dir=glue", "--set", "glue.tasks=[MRPC,RTE]")
    line = assert_one_line_refusal(proc, "GLUE data incomplete")
    assert str(glue / "dev.tsv") in line and str(tmp_path / "glue" / "RTE" / "train.tsv") in line
    assert no_manifest_under(tmp_path)


def test_pretrain_layout_that_would_hang_the_local_ray_is_refused(sample_copy):
    proc = bertpipe(sample_copy, "run", "--set", "ray.num_cpus=2")
    assert_one_line_refusal(proc, "plus at least 1 for data loading", "the Ray cluster has 2 CPUs")
    assert no_manifest_under(sample_copy)


@pytest.mark.parametrize("argv", [["jobs", "list"], ["jobs", "logs", "raysubmit_x"], ["submit", "--", "run"]])
def test_no_reachable_cluster_is_one_line_with_the_way_to_start_one(tmp_path, argv):
    from ports import free_port_block

    address = f"http://127.0.0.1:{free_port_block(1)}"
    proc = bertpipe(tmp_path, *argv[:1], *(["--address", address] if argv[0] == "submit" else []), *argv[1:],
                    *(["--address", address] if argv[0] == "jobs" else []))
    assert_one_line_refusal(proc, f"no Ray cluster answers at {address}", "infra/local/cluster.sh start")


@pytest.mark.parametrize("name,content,needle", [
    ("empty.xml.bz2", b"", "is empty"),
    ("junk.xml.bz2", b"BZh9" + b"\x00garbage" * 64, "is not a readable bz2/gzip/XML file"),
    ("notes.xml.bz2", bz2.compress(b"plain text, no XML\n" * 50), "is not XML"),
    ("page.xml", b"<html><body><p>a web page</p></body></html>", "root is <html>, not <mediawiki>"),
    ("siteinfo.xml", b"<mediawiki><siteinfo><sitename>W</sitename></siteinfo></mediawiki>", "holds no <page>"),
], ids=["empty", "not-bz2", "bz2-not-xml", "html", "no-page"])
def test_dump_that_is_not_a_mediawiki_dump_is_refused_before_ray(tmp_path, name, content, needle):
    (tmp_path / name).write_bytes(content)
    proc = bertpipe(tmp_path, "run", "--workdir", "w", "--set", f"clean.input={name}", ray_tmp=tmp_path / "ray")
    assert_one_line_refusal(proc, needle, str(tmp_path / name))
    assert not (tmp_path / "ray").exists()  # the dump's head was read; no Ray was started
    assert not (tmp_path / "w").exists()


def test_vocab_without_the_special_tokens_is_refused_before_ray(tmp_path):
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\nhello\nworld\n")
    (tmp_path / "corpus.txt").write_text("One sentence.\nAnother one.\n\nA second document.\n")
    for args in (["--only", "vocab"], ["--only", "pairs", "--set", "pairs.input=corpus.txt"]):
        proc = bertpipe(tmp_path, "run", "--workdir", "w", "--set", "vocab.path=vocab.txt", *args)
        assert_one_line_refusal(proc, "lacks the special tokens ['[SEP]', '[MASK]']")
    assert not (tmp_path / "w").exists()


def test_phase_length_that_pairs_does_not_write_is_refused_before_any_stage(sample_copy):
    proc = bertpipe(sample_copy, "run", "--set", "pairs.max_seq_lengths=[128]")
    assert_one_line_refusal(proc, "pretrain.phases train at max_seq_length [512]", "pairs.max_seq_lengths is [128]")
    assert not (sample_copy / "work").exists()  # (`--only pairs` may write any lengths: test_workflow.py)
