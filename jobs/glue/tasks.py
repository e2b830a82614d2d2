"""The nine GLUE tasks as one table of specs, and one reader for their official TSV layouts.

Every task folder holds train.tsv, dev.tsv and test.tsv (MNLI: dev_matched / dev_mismatched / test_matched /
test_mismatched). The layouts differ in small ways that the table records instead of one class per task:
CoLA's train/dev have no header (label col 1, sentence col 3); MRPC starts with a byte-order mark and its
strings hold unbalanced double quotes, so no file is read with CSV quoting — a row is the line split on tabs;
STS-B's label is a float score in the last of ten columns; MNLI's label is the last column (12 in train, 16 in
dev); QQP has rows with missing fields, which the original BERT code skips (so do we, and count them).
Lines are split on "\\n" only: str.splitlines() would also split on \\x85 or \\u2028 inside a sentence.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from bertpipe.pipeline import storage


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

    @property
    def is_pair(self) -> bool:
        return self.train.text_b is not None


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


def task_present(glue_dir: str, spec: TaskSpec) -> bool:
    """A task counts as present when its folder has a train.tsv."""
    return storage.is_file(storage.join(glue_dir, spec.name, "train.tsv"))


def read_task(glue_dir: str, spec: TaskSpec, *, with_test: bool = True) -> TaskData:
    """All splits of one task from `glue_dir`/<task>/ (any smart_open URI). Missing train/dev → ValueError
    naming the file; missing test files are allowed (no submission for that task)."""
    files: list[dict] = []

    def load(name: str, layout: Layout) -> Examples:
        uri = storage.join(glue_dir, spec.name, name)
        try:
            data = storage.read_bytes(uri)
        except Exception as e:  # noqa: BLE001 - FileNotFoundError locally, store-specific errors remotely
            raise ValueError(f"{uri}: cannot read ({type(e).__name__}: {e})") from e
        files.append({"uri": uri, "size": len(data), "checksum": "sha256:" + hashlib.sha256(data).hexdigest()})
        return parse_tsv(data, spec, layout, uri)

    train = load("train.tsv", spec.train)
    dev = {ev: load(fname, spec.dev) for ev, fname in spec.dev_files}
    test = {}
    if with_test:
        for ev, fname in spec.test_files:
            if storage.is_file(storage.join(glue_dir, spec.name, fname)):
                test[ev] = load(fname, spec.test)
    return TaskData(spec, train, dev, test, files)
