"""GLUE readers: official row counts on the real files, the other four layouts on small files written here,
and errors that name the file and line."""
from __future__ import annotations

import numpy as np
import pytest

from bertpipe.jobs.glue.sample import sample_files, write_sample
from bertpipe.jobs.glue.tasks import TASKS, get_task, parse_tsv, read_task, task_present

OFFICIAL = {"CoLA": (1043, 8551, 1063), "MRPC": (408, 3668, 1725), "SST-2": (872, 67349, 1821),
            "STS-B": (1500, 5749, 1379), "WNLI": (71, 635, 146)}


@pytest.mark.parametrize("task", sorted(OFFICIAL))
def test_official_row_counts_on_real_files(shared_glue_dir, task):
    data = read_task(str(shared_glue_dir), TASKS[task])
    dev, train, test = OFFICIAL[task]
    assert (len(data.dev[task]), len(data.train), len(data.test[task])) == (dev, train, test)
    assert len(data.dev[task].labels) == dev and data.test[task].labels is None
    assert data.test[task].index[:3] == ["0", "1", "2"] and data.test[task].index[-1] == str(test - 1)
    assert len(data.files) == 3 and all(f["checksum"].startswith("sha256:") for f in data.files)


def test_real_file_details(shared_glue_dir):
    mrpc = read_task(str(shared_glue_dir), TASKS["MRPC"])
    # No byte-order mark in the first row, and a string with an unbalanced quote stays whole (no CSV quoting).
    assert mrpc.train.labels[:2].tolist() == [1, 0]
    first_dev_b = mrpc.dev["MRPC"].text_b[0]
    assert first_dev_b.startswith('"The foodservice pie business') and first_dev_b.count('"') == 1
    stsb = read_task(str(shared_glue_dir), TASKS["STS-B"])
    assert stsb.train.labels.dtype == np.float32 and stsb.train.labels[:2].tolist() == pytest.approx([5.0, 3.8])
    assert 0.0 <= stsb.dev["STS-B"].labels.min() and stsb.dev["STS-B"].labels.max() <= 5.0
    cola = read_task(str(shared_glue_dir), TASKS["CoLA"])
    assert cola.dev["CoLA"].text_a[0] == "The sailors rode the breeze clear of the rocks."  # header-less
    assert cola.dev["CoLA"].text_b is None and set(np.unique(cola.train.labels)) == {0, 1}


def _write(root, task, files):
    (root / task).mkdir(parents=True, exist_ok=True)
    for name, lines in files.items():
        (root / task / name).write_text("\n".join("\t".join(r) for r in lines) + "\n", encoding="utf-8")


MNLI_TRAIN_HEAD = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                   "sentence1_parse", "sentence2_parse", "sentence1", "sentence2"]


def test_mnli_qnli_qqp_rte_official_layouts(tmp_path):
    p = ["( a )"] * 4
    _write(tmp_path, "MNLI", {
        "train.tsv": [MNLI_TRAIN_HEAD + ["label1", "gold_label"],
                      ["0", "1", "1e", "fiction", *p, "A man sleeps.", "A man rests.", "entailment", "entailment"],
                      ["1", "2", "2n", "fiction", *p, "It rains.", "It is dry.", "contradiction", "contradiction"]],
        "dev_matched.tsv": [MNLI_TRAIN_HEAD + ["label1", "label2", "label3", "label4", "label5", "gold_label"],
                            ["0", "3", "3n", "slate", *p, "Cats purr.", "Cats are big.", *["neutral"] * 6]],
        "dev_mismatched.tsv": [MNLI_TRAIN_HEAD + ["label1", "label2", "label3", "label4", "label5", "gold_label"],
                               ["0", "4", "4e", "nine", *p, "Dogs bark.", "Dogs make noise.", *["entailment"] * 6],
                               ["1", "5", "5c", "nine", *p, "Snow.", "Heat.", *["contradiction"] * 6]],
        "test_matched.tsv": [MNLI_TRAIN_HEAD, ["7", "6", "6", "slate", *p, "X.", "Y."]],
        "test_mismatched.tsv": [MNLI_TRAIN_HEAD, ["9", "7", "7", "nine", *p, "Z.", "W."]]})
    mnli = read_task(str(tmp_path), TASKS["MNLI"])
    assert mnli.train.labels.tolist() == [1, 0] and mnli.train.text_b == ["A man rests.", "It is dry."]
    assert mnli.dev["MNLI-m"].labels.tolist() == [2] and mnli.dev["MNLI-mm"].labels.tolist() == [1, 0]
    assert mnli.test["MNLI-m"].index == ["7"] and mnli.test["MNLI-mm"].text_a == ["Z."]

    _write(tmp_path, "QNLI", {"train.tsv": [["index", "question", "sentence", "label"],
                                            ["0", "Who?", "Bob did.", "entailment"],
                                            ["1", "When?", "Blue sky.", "not_entailment"],
                                            ["2", "Why?", "Because.", "entailment"]],
                              "dev.tsv": [["index", "question", "sentence", "label"],
                                          ["0", "How?", "So.", "entailment"]]})
    qnli = read_task(str(tmp_path), TASKS["QNLI"])
    assert qnli.train.labels.tolist() == [0, 1, 0] and qnli.test == {}  # no test.tsv: allowed

    _write(tmp_path, "RTE", {"train.tsv": [["index", "sentence1", "sentence2", "label"],
                                           ["0", "A is B.", "B is A.", "not_entailment"]],
                             "dev.tsv": [["index", "sentence1", "sentence2", "label"], ["0", "C.", "D.", "entailment"]],
                             "test.tsv": [["index", "sentence1", "sentence2"], ["0", "E.", "F."]]})
    rte = read_task(str(tmp_path), TASKS["RTE"])
    assert rte.train.labels.tolist() == [1] and rte.test["RTE"].text_b == ["F."]

    head = ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"]
    _write(tmp_path, "QQP", {"train.tsv": [head, ["0", "1", "2", "Is it?", "Is it so?", "1"],
                                           ["1", "3", "4", "How come"],  # malformed: split question
                                           ["2", "5", "6", "What?", "Which?", "0"]],
                             "dev.tsv": [head, ["0", "1", "2", "A?", "B?", "0"]],
                             "test.tsv": [["id", "question1", "question2"], ["0", "C?", "D?"]]})
    qqp = read_task(str(tmp_path), TASKS["QQP"])
    assert qqp.train.labels.tolist() == [1, 0] and qqp.train.num_skipped == 1
    assert qqp.test["QQP"].text_a == ["C?"] and qqp.test["QQP"].text_b == ["D?"]


def test_errors_name_file_and_line(tmp_path):
    rte = get_task("RTE")
    good = b"index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n"
    with pytest.raises(ValueError, match=r"RTE/dev.tsv:3: unknown label 'maybe'"):
        parse_tsv(good + b"1\tc\td\tmaybe\n", rte, rte.dev, "RTE/dev.tsv")
    with pytest.raises(ValueError, match=r"x.tsv:2: malformed row, 2 tab-separated fields, need at least 4"):
        parse_tsv(b"index\tsentence1\tsentence2\tlabel\n0\tonly\n", rte, rte.dev, "x.tsv")
    with pytest.raises(ValueError, match=r"e.tsv: empty file"):
        parse_tsv(b"index\tsentence1\tsentence2\tlabel\n", rte, rte.dev, "e.tsv")
    stsb = get_task("STS-B")
    row = "\t".join(["0", "g", "f", "y", "0", "n", "n", "a", "b", "high"])
    with pytest.raises(ValueError, match=r"s.tsv:2: score 'high' is not a number"):
        parse_tsv(("h\n" + row + "\n").encode(), stsb, stsb.dev, "s.tsv")
    (tmp_path / "RTE").mkdir()
    (tmp_path / "RTE" / "train.tsv").write_bytes(good)
    assert task_present(str(tmp_path), rte) and not task_present(str(tmp_path), get_task("CoLA"))
    with pytest.raises(ValueError, match=r"RTE/dev.tsv: cannot read"):
        read_task(str(tmp_path), rte)
    with pytest.raises(ValueError, match="unknown GLUE task 'SST2'"):
        get_task("SST2")


def test_text_with_unicode_line_separators_stays_one_row():
    sst = get_task("SST-2")
    ex = parse_tsv("sentence\tlabel\nfine\u2028film\x85here \t1\r\n".encode(), sst, sst.dev, "s.tsv")
    assert len(ex) == 1 and ex.labels.tolist() == [1]


def test_smoke_sample_reads_with_every_reader(tmp_path):
    write_sample(str(tmp_path))
    assert "NOT GLUE" in (tmp_path / "README.txt").read_text()
    assert (tmp_path / "MRPC" / "train.tsv").read_bytes().startswith("\ufeff".encode())
    for name, spec in TASKS.items():
        data = read_task(str(tmp_path), spec)
        assert len(data.train) == 96 and all(len(d) == 24 for d in data.dev.values())
        assert len(data.test) == len(spec.test_files) + (name == "MNLI")  # MNLI: and the diagnostic set AX
        if not spec.is_regression:  # every label occurs
            assert set(np.unique(data.train.labels)) == set(range(spec.num_labels))
    assert sample_files(seed=3) == sample_files(seed=3) != sample_files(seed=4)


# ---------------------------------------------------------------------------------------------------------
# Hugging Face `datasets` Parquet folders (the nyu-mll/glue layout), read as the TSVs are (issue 36, item 3).

# Written down here from the nyu-mll/glue dataset card, independently of the reader's table: folder, text columns,
# the ClassLabel names in id order (None: STS-B's float score).
HF_CARD = {
    "CoLA": ("cola", ("sentence",), ("unacceptable", "acceptable")),
    "SST-2": ("sst2", ("sentence",), ("negative", "positive")),
    "MRPC": ("mrpc", ("sentence1", "sentence2"), ("not_equivalent", "equivalent")),
    "STS-B": ("stsb", ("sentence1", "sentence2"), None),
    "QQP": ("qqp", ("question1", "question2"), ("not_duplicate", "duplicate")),
    "MNLI": ("mnli", ("premise", "hypothesis"), ("entailment", "neutral", "contradiction")),
    "QNLI": ("qnli", ("question", "sentence"), ("entailment", "not_entailment")),
    "RTE": ("rte", ("sentence1", "sentence2"), ("entailment", "not_entailment")),
    "WNLI": ("wnli", ("sentence1", "sentence2"), ("not_entailment", "entailment")),
}
# The TSVs' label strings -> the card's names (the binary tasks' TSVs say 0/1).
TSV_TO_CARD = {"CoLA": {"0": "unacceptable", "1": "acceptable"}, "SST-2": {"0": "negative", "1": "positive"},
               "MRPC": {"0": "not_equivalent", "1": "equivalent"}, "QQP": {"0": "not_duplicate", "1": "duplicate"},
               "WNLI": {"0": "not_entailment", "1": "entailment"}}
SPLIT = {"train": "train", "MNLI-m": "validation_matched", "MNLI-mm": "validation_mismatched"}


def _write_hf(root, task: str, split: str, ex, test: bool, shards: int = 1) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder, cols, names = HF_CARD[task]
    data = {cols[0]: ex.text_a}
    if len(cols) > 1:
        data[cols[1]] = ex.text_b
    if test:
        data["label"] = [-1] * len(ex)
        data["idx"] = [int(i) for i in ex.index]
    else:
        spec = TASKS[task]
        if names is None:
            data["label"] = ex.labels.astype("float32").tolist()
        else:
            card = TSV_TO_CARD.get(task, {})
            data["label"] = [names.index(card.get(s, s)) for s in (spec.labels[i] for i in ex.labels)]
        data["idx"] = list(range(len(ex)))
    (root / folder).mkdir(parents=True, exist_ok=True)
    table = pa.table(data)
    step = -(-len(ex) // shards)
    for n in range(shards):  # datasets' shard names: <split>-0000n-of-0000N.parquet
        pq.write_table(table.slice(n * step, step), root / folder / f"{split}-{n:05d}-of-{shards:05d}.parquet")


def _same(a, b) -> None:
    assert a.text_a == b.text_a and a.text_b == b.text_b and a.index == b.index
    if a.labels is None:
        assert b.labels is None
    else:
        assert a.labels.dtype == b.labels.dtype and a.labels.tolist() == b.labels.tolist()


def test_a_hugging_face_parquet_folder_reads_row_for_row_as_the_tsvs(tmp_path):
    tsv_dir = tmp_path / "tsv"
    write_sample(str(tsv_dir))
    hf = tmp_path / "hf"
    for task in TASKS:
        data = read_task(str(tsv_dir), TASKS[task])
        _write_hf(hf, task, "train", data.train, False, shards=2 if task == "QQP" else 1)
        for name, ex in data.dev.items():
            _write_hf(hf, task, SPLIT.get(name, "validation"), ex, False)
        for name, ex in data.test.items():
            if name == "AX":
                _write_hf(hf, "MNLI", "test", ex, True)
                (hf / "mnli" / "test-00000-of-00001.parquet").rename(hf / "ax.parquet")
                continue
            _write_hf(hf, task, {"MNLI-m": "test_matched", "MNLI-mm": "test_mismatched"}.get(name, "test"), ex, True)
    (hf / "ax").mkdir()
    (hf / "ax.parquet").rename(hf / "ax" / "test-00000-of-00001.parquet")
    for task, spec in TASKS.items():
        assert task_present(str(hf), spec) and not (hf / task).exists()
        want, got = read_task(str(tsv_dir), spec), read_task(str(hf), spec)
        assert len(got.train) > 0 and set(got.dev) == set(want.dev) and set(got.test) == set(want.test), task
        _same(want.train, got.train)
        for name in want.dev:
            _same(want.dev[name], got.dev[name])
        for name in want.test:
            _same(want.test[name], got.test[name])
        assert all(f["uri"].endswith(".parquet") for f in got.files)
    assert "AX" in read_task(str(hf), TASKS["MNLI"]).test
    # A folder holding both: the TSVs win (chosen by what the folder holds, per task).
    (hf / "RTE").mkdir()
    (hf / "RTE" / "train.tsv").write_bytes((tsv_dir / "RTE" / "train.tsv").read_bytes())
    (hf / "RTE" / "dev.tsv").write_bytes((tsv_dir / "RTE" / "dev.tsv").read_bytes())
    assert all(f["uri"].endswith(".tsv") for f in read_task(str(hf), TASKS["RTE"]).files)


def test_a_parquet_file_without_the_tasks_columns_is_one_error_naming_them(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "sst2").mkdir()
    pq.write_table(pa.table({"text": ["a"], "label": [1], "idx": [0]}), tmp_path / "sst2" / "train.parquet")
    with pytest.raises(ValueError, match=r"sst2/train.parquet: no column sentence \(the nyu-mll/glue columns"):
        read_task(str(tmp_path), TASKS["SST-2"])
    pq.write_table(pa.table({"sentence": ["a"], "label": [7], "idx": [0]}), tmp_path / "sst2" / "train.parquet")
    with pytest.raises(ValueError, match=r"row 0: label 7 is not a SST-2 class id"):
        read_task(str(tmp_path), TASKS["SST-2"])


def test_the_smoke_sample_ships_the_diagnostic_set(tmp_path):
    files = sample_files()
    ax = files["diagnostic/diagnostic.tsv"].splitlines()
    assert ax[0] == "index\tsentence1\tsentence2" and len(ax) == 1 + 12
    assert [r.split("\t")[0] for r in ax[1:]] == [str(i) for i in range(12)]
    mnli = read_task(write_sample(str(tmp_path)), TASKS["MNLI"])
    assert set(mnli.test) == {"MNLI-m", "MNLI-mm", "AX"} and mnli.test["AX"].labels is None
    assert mnli.test["AX"].index == [str(i) for i in range(12)]
