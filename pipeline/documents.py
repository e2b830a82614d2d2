"""Documents as the vocab and pairs stages read them: the clean stage's Parquet files, or plain text.

Plain text is google-research/bert's input format: one sentence per line, a blank line between documents. A user
with their own corpus (books, a non-Wikipedia crawl, a WikiExtractor output flattened to that format) points
`vocab.input` / `pairs.input` at such files instead of running the clean stage. Each text document gets a stable
id from its file name and position, so held-out selection is the same on every run.
"""
from __future__ import annotations

import hashlib
import posixpath
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from bertpipe.pipeline import storage
from bertpipe.pipeline.stage import StageInputError

TEXT_SUFFIXES = (".txt",)


def document_files(uri: str) -> list[str]:
    """The document files of `uri`, sorted: the file itself, or a folder's Parquet files (else its text files)."""
    if uri.endswith((".parquet", *TEXT_SUFFIXES)):
        if not storage.exists(uri):
            raise StageInputError(f"documents {uri} do not exist")
        return [uri]
    if not storage.exists(uri):
        raise StageInputError(f"documents folder {uri} does not exist")
    names = [p for p, _ in storage.list_files(uri)]
    for suffixes in ((".parquet",), TEXT_SUFFIXES):
        files = [storage.join(uri, p) for p in names if p.endswith(suffixes)]
        if files:
            return files
    raise StageInputError(f"no documents in {uri}: expected Parquet files with a `text` column (a clean stage "
                          "output) or .txt files (one sentence per line, blank line between documents)")


def _doc_id(source: str, index: int) -> int:
    digest = hashlib.sha256(f"{posixpath.basename(source)}#{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # non-negative int64


def text_documents(data: bytes, source: str) -> list[dict[str, Any]]:
    """{id, title, text} per document of a text file; text keeps one sentence per line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StageInputError(f"{source} is not UTF-8 text: {exc}") from exc
    docs, lines = [], []
    for line in text.split("\n") + [""]:
        line = line.strip()
        if line:
            lines.append(line)
        elif lines:
            docs.append({"id": _doc_id(source, len(docs)), "title": "", "text": "\n".join(lines)})
            lines = []
    return docs


def _read_bytes(uri: str) -> bytes:
    fs, path = storage.resolve(uri)
    with fs.open_input_stream(path) as f:
        return f.read()


def _parquet_texts(uri: str, batch_rows: int) -> Iterator[list[str]]:
    fs, path = storage.resolve(uri)
    with fs.open_input_file(path) as f:
        parquet = pq.ParquetFile(f)
        if "text" not in parquet.schema_arrow.names:
            raise StageInputError(f"{uri} has no `text` column (columns: {parquet.schema_arrow.names})")
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=["text"]):
            yield [t for t in batch.column(0).to_pylist() if t]


def iter_texts(files: list[str], batch_rows: int = 1024) -> Iterator[list[str]]:
    """Document texts, one batch at a time (bounded memory whatever the corpus size)."""
    for uri in files:
        try:
            if uri.endswith(TEXT_SUFFIXES):
                docs = [d["text"] for d in text_documents(_read_bytes(uri), uri)]
                for i in range(0, len(docs), batch_rows):
                    yield docs[i:i + batch_rows]
            else:
                yield from _parquet_texts(uri, batch_rows)
        except (OSError, pa.ArrowException) as exc:
            raise StageInputError(f"cannot read documents {uri}: {exc}") from exc


def _text_file_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"id": d["id"], "text": d["text"]} for d in text_documents(_read_bytes(row["uri"]), row["uri"])]


def read_documents(files: list[str]):
    """A Ray dataset of (id int64, text string) rows over `files`, in file order."""
    import ray.data

    if all(f.endswith(".parquet") for f in files):
        return ray.data.read_parquet(files).select_columns(["id", "text"])
    return ray.data.from_items([{"uri": f} for f in files], override_num_blocks=len(files)).flat_map(_text_file_rows)
