"""The nine GLUE tasks as one table of specs, and one reader for their official TSV layouts.

Every task folder holds train.tsv, dev.tsv and test.tsv (MNLI: dev_matched / dev_mismatched / test_matched /
test_mismatched). The layouts differ in small ways that the table records instead of one class per task:
CoLA's train/dev have no header (label col 1, sentence col 3); MRPC starts with a byte-order mark and its
strings hold unbalanced double quotes, so no file is read with CSV quoting — a row is the line split on tabs;
STS-B's label is a float score in the last of ten columns; MNLI's label is the last column (12 in train, 16 in
dev); QQP has rows with missing fields, which the original BERT code skips (so do we, and count them).
Lines are split on "\\n" only: str.splitlines() would also split on \\x85 or \\u2028 inside a sentence.

The same data as Hugging Face `datasets` Parquet files (the `nyu-mll/glue` repository's layout) is read too, chosen
per task by what the folder holds: <Task>/train.tsv (the TSV layout) wins, else <hf name>/train*.parquet (HF_GLUE).

The diagnostic set AX (test only, no labels) is predicted by the MNLI model: `diagnostic/diagnostic.tsv` (index,
sentence1, sentence2) or `ax/test*.parquet`, read with MNLI's test sets as its "AX" test set, so that AX.tsv
joins the submission zip as gluebenchmark.com expects.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from bertpipe.pipeline.framework import storage


@dataclass(frozen=True)
class Layout:
    """Columns of one kind of file (0-based; -1 = last column)."""

    header: bool
    text_a: int
    text_b: int | None = None
    label: int | None = None  # None for test files
    index: int | None = None  # test files: the column holding the submission index


@dataclass(frozen=True)
class TaskSpec:
    name: str  # folder name, as the GLUE download spells it
    labels: tuple[str, ...] | None  # label strings in the files, in id order; None = regression (STS-B)
    train: Layout
    dev: Layout
    test: Layout
    metrics: tuple[str, ...]  # official dev metrics; the task score is their mean
    # (evaluation name, file): MNLI has a matched and a mismatched dev/test set, the others one each.
    dev_files: tuple[tuple[str, str], ...] = ()
    test_files: tuple[tuple[str, str], ...] = ()
    # QQP's files have rows with missing fields; the original BERT code skips them, so do we (and count them).
    skip_malformed: bool = False

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    @property
    def is_regression(self) -> bool:
        return self.labels is None


def _one(name: str) -> tuple[tuple[str, str], ...]:
    return ((name, "dev.tsv"),)


def _one_test(name: str) -> tuple[tuple[str, str], ...]:
    return ((name, "test.tsv"),)


_BIN = ("0", "1")
_NLI2 = ("entailment", "not_entailment")
_NLI3 = ("contradiction", "entailment", "neutral")  # the order of the original MnliProcessor

TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("CoLA", _BIN, Layout(False, 3, label=1), Layout(False, 3, label=1), Layout(True, 1, index=0),
             ("mcc",), _one("CoLA"), _one_test("CoLA")),
    TaskSpec("SST-2", _BIN, Layout(True, 0, label=1), Layout(True, 0, label=1), Layout(True, 1, index=0),
             ("accuracy",), _one("SST-2"), _one_test("SST-2")),
    TaskSpec("MRPC", _BIN, Layout(True, 3, 4, label=0), Layout(True, 3, 4, label=0), Layout(True, 3, 4, index=0),
             ("f1", "accuracy"), _one("MRPC"), _one_test("MRPC")),
    TaskSpec("STS-B", None, Layout(True, 7, 8, label=-1), Layout(True, 7, 8, label=-1),
             Layout(True, 7, 8, index=0), ("pearson", "spearman"), _one("STS-B"), _one_test("STS-B")),
    TaskSpec("QQP", _BIN, Layout(True, 3, 4, label=5), Layout(True, 3, 4, label=5), Layout(True, 1, 2, index=0),
             ("f1", "accuracy"), _one("QQP"), _one_test("QQP"), skip_malformed=True),
    TaskSpec("MNLI", _NLI3, Layout(True, 8, 9, label=-1), Layout(True, 8, 9, label=-1),
             Layout(True, 8, 9, index=0), ("accuracy",),
             (("MNLI-m", "dev_matched.tsv"), ("MNLI-mm", "dev_mismatched.tsv")),
             (("MNLI-m", "test_matched.tsv"), ("MNLI-mm", "test_mismatched.tsv"))),
    TaskSpec("QNLI", _NLI2, Layout(True, 1, 2, label=3), Layout(True, 1, 2, label=3), Layout(True, 1, 2, index=0),
             ("accuracy",), _one("QNLI"), _one_test("QNLI")),
    TaskSpec("RTE", _NLI2, Layout(True, 1, 2, label=3), Layout(True, 1, 2, label=3), Layout(True, 1, 2, index=0),
             ("accuracy",), _one("RTE"), _one_test("RTE")),
    TaskSpec("WNLI", _BIN, Layout(True, 1, 2, label=3), Layout(True, 1, 2, label=3), Layout(True, 1, 2, index=0),
             ("accuracy",), _one("WNLI"), _one_test("WNLI")),
)}
# The nine task names in the leaderboard's order: the one list the project uses.
GLUE_TASKS: tuple[str, ...] = tuple(TASKS)


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise ValueError(f"unknown GLUE task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]


@dataclass
class Examples:
    """One split, column-wise. labels: int64 label ids, float32 scores (STS-B), or None (test)."""

    source: str  # file it came from, for messages
    text_a: list[str]
    text_b: list[str] | None
    labels: np.ndarray | None = None
    index: list[str] | None = None  # test: submission index column
    num_skipped: int = 0  # malformed rows skipped (QQP only)

    def __len__(self) -> int:
        return len(self.text_a)

    def take(self, rows: np.ndarray) -> "Examples":
        pick = [int(i) for i in rows]
        return Examples(self.source, [self.text_a[i] for i in pick],
                        None if self.text_b is None else [self.text_b[i] for i in pick],
                        None if self.labels is None else self.labels[pick],
                        None if self.index is None else [self.index[i] for i in pick], self.num_skipped)


@dataclass
class TaskData:
    spec: TaskSpec
    train: Examples
    dev: dict[str, Examples]
    test: dict[str, Examples] = field(default_factory=dict)  # empty when the folder has no test files
    # Raw inputs read: {"uri", "size", "checksum"} for the manifest's fingerprint.
    files: list[dict] = field(default_factory=list)


def parse_tsv(data: bytes, spec: TaskSpec, layout: Layout, source: str) -> Examples:
    """Rows of one GLUE file. Errors name `source` and the 1-based line number."""
    try:
        text = data.decode("utf-8-sig")  # MRPC starts with a byte-order mark
    except UnicodeDecodeError as e:
        raise ValueError(f"{source}: not UTF-8 ({e})") from e
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    first = 1 if layout.header else 0
    if len(lines) <= first:
        raise ValueError(f"{source}: empty file (no data rows)")
    cols = [c for c in (layout.text_a, layout.text_b, layout.label, layout.index) if c is not None]
    need = max(c + 1 if c >= 0 else 1 for c in cols)
    label_ids = {s: i for i, s in enumerate(spec.labels or ())}
    a, b, labels, index = [], [] if layout.text_b is not None else None, [], []
    skipped = 0
    for n, line in enumerate(lines[first:], start=first + 1):
        row = line.rstrip("\r").split("\t")
        if len(row) < need or (layout.label == -1 and len(row) < 2):
            if spec.skip_malformed:
                skipped += 1
                continue
            raise ValueError(f"{source}:{n}: malformed row, {len(row)} tab-separated fields, need at least {need}")
        if layout.label is not None:
            raw = row[layout.label].strip()
            if spec.is_regression:
                try:
                    labels.append(float(raw))
                except ValueError:
                    raise ValueError(f"{source}:{n}: score {raw!r} is not a number") from None
            elif raw in label_ids:
                labels.append(label_ids[raw])
            elif spec.skip_malformed:
                skipped += 1
                continue
            else:
                raise ValueError(f"{source}:{n}: unknown label {raw!r}; {spec.name} labels are {list(spec.labels)}")
        a.append(row[layout.text_a])
        if b is not None:
            b.append(row[layout.text_b])
        if layout.index is not None:
            index.append(row[layout.index].strip())
    if not a:
        raise ValueError(f"{source}: no usable rows ({skipped} malformed rows skipped)")
    arr = None
    if layout.label is not None:
        arr = np.asarray(labels, dtype=np.float32 if spec.is_regression else np.int64)
    return Examples(source, a, b, arr, index if layout.index is not None else None, skipped)


# Hugging Face's nyu-mll/glue layout (the Parquet files `datasets` reads; huggingface.co/datasets/nyu-mll/glue):
#   one folder per task, lower-case names: cola sst2 mrpc qqp stsb mnli qnli rte wnli ax;
#   files <split>-00000-of-00001.parquet, splits train, validation, test (MNLI: validation_matched,
#   validation_mismatched, test_matched, test_mismatched; ax: test only);
#   columns: cola/sst2 sentence, label, idx; mrpc/stsb/rte/wnli sentence1, sentence2, label, idx; qqp question1,
#   question2, label, idx; mnli/ax premise, hypothesis, label, idx; qnli question, sentence, label, idx.
#   label is int64 class id (-1 in test splits), stsb's a float score. Class ids by HF's ClassLabel names:
#   cola unacceptable/acceptable, sst2 negative/positive, mrpc not_equivalent/equivalent, qqp not_duplicate/duplicate,
#   wnli not_entailment/entailment (= the TSVs' 0/1); mnli entailment/neutral/contradiction; qnli and rte
#   entailment/not_entailment. HF_LABELS gives each id the label string the TSVs use.
HF_GLUE: dict[str, tuple[str, tuple[str, str | None]]] = {
    "CoLA": ("cola", ("sentence", None)), "SST-2": ("sst2", ("sentence", None)),
    "MRPC": ("mrpc", ("sentence1", "sentence2")), "STS-B": ("stsb", ("sentence1", "sentence2")),
    "QQP": ("qqp", ("question1", "question2")), "MNLI": ("mnli", ("premise", "hypothesis")),
    "QNLI": ("qnli", ("question", "sentence")), "RTE": ("rte", ("sentence1", "sentence2")),
    "WNLI": ("wnli", ("sentence1", "sentence2")),
}
HF_LABELS: dict[str, tuple[str, ...]] = {"MNLI": ("entailment", "neutral", "contradiction"), "QNLI": _NLI2,
                                         "RTE": _NLI2}
# The TSV file name of a split -> its HF split name.
HF_SPLITS = {"train.tsv": "train", "dev.tsv": "validation", "test.tsv": "test",
             "dev_matched.tsv": "validation_matched", "dev_mismatched.tsv": "validation_mismatched",
             "test_matched.tsv": "test_matched", "test_mismatched.tsv": "test_mismatched"}
AX = ("AX", "diagnostic/diagnostic.tsv", "ax")  # the test set's name, its TSV path, its HF folder
AX_LAYOUT = Layout(True, 1, 2, index=0)


def parquet_files(glue_dir: str, folder: str, split: str) -> list[str]:
    """The Parquet files of one HF split (<split>.parquet or <split>-NNNNN-of-NNNNN.parquet shards), in order."""
    base = storage.join(glue_dir, folder)
    return [storage.join(base, rel) for rel, _ in storage.list_files(base) if "/" not in rel
            and rel.endswith(".parquet") and (rel == f"{split}.parquet" or rel.startswith(f"{split}-"))]


def has_split(glue_dir: str, spec: TaskSpec, fname: str) -> bool:
    """Whether the task's split (named by its TSV file) is in the folder, in the task's format."""
    if task_format(glue_dir, spec) == "parquet":
        return bool(parquet_files(glue_dir, HF_GLUE[spec.name][0], HF_SPLITS[fname]))
    return storage.is_file(storage.join(glue_dir, spec.name, fname))


def task_format(glue_dir: str, spec: TaskSpec) -> str:
    """"tsv" when <Task>/train.tsv is there, else "parquet" when the HF folder has a train split, else ""."""
    if storage.is_file(storage.join(glue_dir, spec.name, "train.tsv")):
        return "tsv"
    return "parquet" if parquet_files(glue_dir, HF_GLUE[spec.name][0], "train") else ""


def split_uri(glue_dir: str, spec: TaskSpec, fname: str) -> str:
    """Where a split (named by its TSV file) of the task is: the TSV, or the HF folder's first file of that split."""
    if task_format(glue_dir, spec) != "parquet":
        return storage.join(glue_dir, spec.name, fname)
    files = parquet_files(glue_dir, HF_GLUE[spec.name][0], HF_SPLITS[fname])
    return files[0] if files else storage.join(glue_dir, HF_GLUE[spec.name][0], f"{HF_SPLITS[fname]}-*.parquet")


def task_present(glue_dir: str, spec: TaskSpec) -> bool:
    """A task counts as present when its folder has a train.tsv, or its HF folder a train split."""
    return bool(task_format(glue_dir, spec))


def parse_parquet(blobs: list[tuple[str, bytes]], spec: TaskSpec, columns: tuple[str, str | None], test: bool,
                  source: str) -> Examples:
    """Rows of one HF split (its Parquet shards, in order) as the TSV reader gives them: label ids in the table's
    order, STS-B scores as float32, the test sets' idx as the submission index."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for uri, data in blobs:
        try:
            tables.append(pq.read_table(io.BytesIO(data)))
        except pa.ArrowException as e:
            raise ValueError(f"{uri}: not a Parquet file ({e})") from e
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    need = [c for c in (*columns, "label", "idx") if c]
    missing = [c for c in need if c not in table.column_names]
    if missing:
        raise ValueError(f"{source}: no column {', '.join(missing)} (the nyu-mll/glue columns of {spec.name} are "
                         f"{', '.join(need)}; found {', '.join(table.column_names)})")
    if table.num_rows == 0:
        raise ValueError(f"{source}: empty file (no data rows)")
    a = [str(x) for x in table.column(columns[0]).to_pylist()]
    b = None if columns[1] is None else [str(x) for x in table.column(columns[1]).to_pylist()]
    index = [str(i) for i in table.column("idx").to_pylist()] if test else None
    labels = None
    if not test:
        raw = table.column("label").to_pylist()
        if spec.is_regression:
            labels = np.asarray(raw, dtype=np.float32)
        else:
            names = HF_LABELS.get(spec.name, spec.labels)
            ids = {s: i for i, s in enumerate(spec.labels)}
            bad = next((n for n, x in enumerate(raw) if x is None or not 0 <= int(x) < len(names)), None)
            if bad is not None:
                raise ValueError(f"{source}: row {bad}: label {raw[bad]!r} is not a {spec.name} class id "
                                 f"(0..{len(names) - 1})")
            labels = np.asarray([ids[names[int(x)]] for x in raw], dtype=np.int64)
    return Examples(source, a, b, labels, index, 0)


def read_task(glue_dir: str, spec: TaskSpec, *, with_test: bool = True) -> TaskData:
    """All splits of one task from `glue_dir` (any smart_open URI): <Task>/*.tsv, else the HF Parquet folder
    (task_format). Missing train/dev → ValueError naming the file; missing test files are allowed (no submission for
    that task). MNLI also reads the diagnostic set AX as a test set when the folder has it."""
    files: list[dict] = []
    fmt = task_format(glue_dir, spec) or "tsv"
    folder, columns = HF_GLUE[spec.name]

    def fetch(uri: str) -> bytes:
        try:
            data = storage.read_bytes(uri)
        except Exception as e:  # noqa: BLE001 - FileNotFoundError locally, store-specific errors remotely
            raise ValueError(f"{uri}: cannot read ({type(e).__name__}: {e})") from e
        files.append({"uri": uri, "size": len(data), "checksum": "sha256:" + hashlib.sha256(data).hexdigest()})
        return data

    def load(name: str, layout: Layout) -> Examples:
        if fmt == "parquet":
            uris = parquet_files(glue_dir, folder, HF_SPLITS[name])
            if not uris:
                raise ValueError(f"{split_uri(glue_dir, spec, name)}: cannot read (no such file)")
            return parse_parquet([(u, fetch(u)) for u in uris], spec, columns, layout.label is None, uris[0])
        uri = storage.join(glue_dir, spec.name, name)
        return parse_tsv(fetch(uri), spec, layout, uri)

    train = load("train.tsv", spec.train)
    dev = {ev: load(fname, spec.dev) for ev, fname in spec.dev_files}
    test = {}
    if with_test:
        for ev, fname in spec.test_files:
            if has_split(glue_dir, spec, fname):
                test[ev] = load(fname, spec.test)
        if spec.name == "MNLI":
            ax = read_ax(glue_dir, fetch)
            if ax is not None:
                test[AX[0]] = ax
    return TaskData(spec, train, dev, test, files)


def read_ax(glue_dir: str, fetch) -> Examples | None:
    """The diagnostic set (index, sentence1, sentence2; no labels) as an MNLI test set, or None when absent."""
    tsv = storage.join(glue_dir, *AX[1].split("/"))
    if storage.is_file(tsv):
        return parse_tsv(fetch(tsv), TASKS["MNLI"], AX_LAYOUT, tsv)
    uris = parquet_files(glue_dir, AX[2], "test")
    if uris:
        return parse_parquet([(u, fetch(u)) for u in uris], TASKS["MNLI"], ("premise", "hypothesis"), True, uris[0])
    return None
