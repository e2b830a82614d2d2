"""Documents as the vocab and pairs stages read them: the clean stage's Parquet files, or plain text.

Plain text is google-research/bert's input format: one sentence per line, a blank line between documents. A user
with their own corpus (books, a non-Wikipedia crawl, a WikiExtractor output flattened to that format) points
`vocab.input` / `pairs.input` at such files instead of running the clean stage. Each text document gets a stable
id from its file name and position, so held-out selection is the same on every run.
"""
from __future__ import annotations

import hashlib
import posixpath
import random
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.stage import StageInputError, manifest_state

TEXT_SUFFIXES = (".txt",)


def document_files(uri: str, manifest: dict[str, Any] | None = None) -> list[str]:
    """The document files of `uri`, sorted: the file itself, or a folder's Parquet files (else its text files).

    A committed stage folder is read as its manifest (`manifest`, or the folder's own) lists it, never as listed
    on disk: a file copied in after the commit is not part of the output the fingerprint names."""
    if uri.endswith((".parquet", *TEXT_SUFFIXES)):
        if not storage.exists(uri):
            raise StageInputError(f"documents {uri} do not exist")
        return [uri]
    if not storage.exists(uri):
        raise StageInputError(f"documents folder {uri} does not exist")
    if not manifest:
        manifest, problem = manifest_state(uri)
        if problem:
            raise StageInputError(f"documents folder {uri}: {problem}")
    names = [f["path"] for f in manifest["files"]] if manifest else [p for p, _ in storage.list_files(uri)]
    for suffixes in ((".parquet",), TEXT_SUFFIXES):
        files = sorted(storage.join(uri, *p.split("/")) for p in names if p.endswith(suffixes))
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


@dataclass(frozen=True)
class TextPiece:
    """The grain documents are sampled at: one row group of a Parquet file, or a whole text file."""

    uri: str
    row_group: int = -1  # -1: the whole file
    num_bytes: int = 0  # text bytes (Parquet: the text column's uncompressed size)


def _parquet_pieces(uri: str) -> list[TextPiece]:
    fs, path = storage.resolve(uri)
    with fs.open_input_file(path) as f:
        meta = pq.ParquetFile(f).metadata
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    if "text" not in names:
        raise StageInputError(f"{uri} has no `text` column (columns: {names})")
    column = names.index("text")
    return [TextPiece(uri, g, meta.row_group(g).column(column).total_uncompressed_size)
            for g in range(meta.num_row_groups)]


def text_pieces(files: list[str]) -> list[TextPiece]:
    """Every piece of `files`, in order, with its size; reads Parquet footers only."""
    out: list[TextPiece] = []
    for uri in files:
        try:
            if uri.endswith(TEXT_SUFFIXES):
                fs, path = storage.resolve(uri)
                out.append(TextPiece(uri, -1, fs.get_file_info(path).size))
            else:
                out.extend(_parquet_pieces(uri))
        except (OSError, pa.ArrowException) as exc:
            raise StageInputError(f"cannot read documents {uri}: {exc}") from exc
    return out


def sample_pieces(pieces: list[TextPiece], max_bytes: int, seed: int) -> list[TextPiece]:
    """Pieces drawn at random (seeded) across the whole corpus until they hold `max_bytes` of text, in corpus
    order; all of them when the corpus is smaller or `max_bytes` is 0."""
    if max_bytes <= 0 or sum(p.num_bytes for p in pieces) <= max_bytes:
        return list(pieces)
    chosen, used = [], 0
    for i in random.Random(seed).sample(range(len(pieces)), len(pieces)):
        if used >= max_bytes:
            break
        chosen.append(i)
        used += pieces[i].num_bytes
    return [pieces[i] for i in sorted(chosen)]


def _piece_texts(piece: TextPiece, batch_rows: int) -> Iterator[list[str]]:
    if piece.uri.endswith(TEXT_SUFFIXES):
        docs = [d["text"] for d in text_documents(_read_bytes(piece.uri), piece.uri)]
        for i in range(0, len(docs), batch_rows):
            yield docs[i:i + batch_rows]
        return
    fs, path = storage.resolve(piece.uri)
    with fs.open_input_file(path) as f:
        parquet = pq.ParquetFile(f)
        if "text" not in parquet.schema_arrow.names:
            raise StageInputError(f"{piece.uri} has no `text` column (columns: {parquet.schema_arrow.names})")
        groups = None if piece.row_group < 0 else [piece.row_group]
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=["text"], row_groups=groups):
            yield [t for t in batch.column(0).to_pylist() if t]


def iter_piece_texts(pieces: list[TextPiece], batch_rows: int = 1024) -> Iterator[list[str]]:
    """Document texts of `pieces`, one batch at a time (bounded memory whatever the corpus size)."""
    for piece in pieces:
        try:
            yield from _piece_texts(piece, batch_rows)
        except (OSError, pa.ArrowException) as exc:
            raise StageInputError(f"cannot read documents {piece.uri}: {exc}") from exc


def _text_file_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"id": d["id"], "text": d["text"]} for d in text_documents(_read_bytes(row["uri"]), row["uri"])]


def read_documents(files: list[str]):
    """A Ray dataset of (id int64, text string) rows over `files` (in file order where its execution preserves
    order)."""
    import ray.data

    from bertpipe.pipeline.framework.ray_reads import read_parquet

    if all(f.endswith(".parquet") for f in files):
        return read_parquet(files, ["id", "text"])
    return ray.data.from_items([{"uri": f} for f in files], override_num_blocks=len(files)).flat_map(_text_file_rows)
