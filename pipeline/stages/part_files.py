"""The part files between the pairs stage's two passes: one pool's instances at one length, as Arrow IPC record
batches of a fixed row count (random access by batch; ~10x faster to write than Parquet; written once, read once,
deleted). Pass 1 gathers them a record batch at a time, so a pool's instance set never exists whole; pass 2 reads
row ranges of them."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.stages.instances import gather_from_pool

# Record batches of the part files hold about this many bytes of instances: what pass 2 reads at least per slice.
PART_BATCH_BYTES = 2**20
_BATCH_ROWS_KEY = b"bertpipe.batch_rows"


def part_batch_rows(max_seq_length: int) -> int:
    """Rows per record batch of a part file at this length (full instances of uint16 ids: 2 bytes a token)."""
    return max(1, PART_BATCH_BYTES // (2 * max_seq_length))


def part_schema(id_type: pa.DataType, batch_rows: int) -> pa.Schema:
    return pa.schema([("input_ids", pa.list_(id_type)), ("segment_b_start", pa.int16()),
                      ("next_sentence_label", pa.int8()), ("num_tokens", pa.int16())],
                     metadata={_BATCH_ROWS_KEY: str(batch_rows).encode()})


def write_part(uri: str, pool: np.ndarray, spans, id_type: pa.DataType, batch_rows: int) -> int:
    """The instances of `spans`, in their order, in record batches of `batch_rows` rows, gathered a batch at a time.
    Returns its bytes of instances."""
    fs, path = storage.resolve(uri)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    tmp, nbytes = storage.temp_path(path), 0
    with fs.open_output_stream(tmp) as f, pa.ipc.new_file(f, part_schema(id_type, batch_rows)) as w:
        for lo in range(0, len(spans), batch_rows):
            table = gather_from_pool(pool, spans.slice(lo, lo + batch_rows), id_type)
            w.write_batch(table.to_batches()[0])  # one chunk per column: one batch
            nbytes += table.nbytes
    fs.move(tmp, path)
    return nbytes


def open_part(uri: str):
    """A part file to read batches from: memory-mapped when local (the page cache holds it, not the task), else a
    random-access stream of the store."""
    fs, path = storage.resolve(uri)
    if isinstance(fs, pafs.LocalFileSystem):
        return pa.memory_map(path)
    return fs.open_input_file(path)


def read_rows(uri: str, first: int, end: int) -> list[pa.RecordBatch]:
    """Rows [first, end) of a part file, as slices of the record batches that hold them."""
    with open_part(uri) as source:
        reader = pa.ipc.open_file(source)
        step = int(reader.schema.metadata[_BATCH_ROWS_KEY])
        out = []
        for b in range(first // step, (end - 1) // step + 1):
            batch = reader.get_batch(b)
            lo = max(first - b * step, 0)
            out.append(batch.slice(lo, min(end - b * step, batch.num_rows) - lo))
        # A mapped batch keeps its mapping alive after the file is closed; the concatenation that follows copies.
        return out

