"""The held-out rows a pre-training worker evaluates on, read once, straight from the pairs stage's held-out shard.

Evaluation reads a bounded number of rows (pretrain.eval_max_batches batches per worker), the same rows every time:
a plain Parquet read of them is simpler and faster than a Ray Data stream, which costs a coordinator process and a
streaming execution per sequence length (seconds each on a small machine) to deliver a few hundred rows. Worker
`rank` of `world` takes the rank-th block of `rows_per_worker` consecutive rows, so every worker runs the same
number of forwards (ZeRO 3 gathers parameters collectively) and no row is evaluated twice.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bertpipe.pipeline.formats.shards import TRAINING_COLUMNS
from bertpipe.pipeline.framework import storage


def rows_per_worker(total_rows: int, world: int, max_batches: int, batch_size: int) -> int:
    return min(total_rows // world, max_batches * batch_size)


def read_heldout(uri: str, rank: int, world: int, total_rows: int, max_batches: int,
                 batch_size: int) -> list[dict[str, np.ndarray]]:
    """This worker's held-out batches of at most `batch_size` rows, as numpy columns (the shape Ray Data's numpy
    batches have: list columns as object arrays of arrays). `uri` is absolute or a URI (see storage.resolve)."""
    n = rows_per_worker(total_rows, world, max_batches, batch_size)
    start, end = rank * n, (rank + 1) * n
    fs, path = storage.resolve(uri)
    pieces, seen = [], 0
    with fs.open_input_file(path) as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=max(batch_size, 1024), columns=TRAINING_COLUMNS):
            lo, hi = max(start - seen, 0), min(end - seen, batch.num_rows)
            if lo < hi:
                pieces.append(batch.slice(lo, hi - lo))
            seen += batch.num_rows
            if seen >= end:
                break
    if sum(p.num_rows for p in pieces) != n:
        raise ValueError(f"held-out shard {uri} has {seen} rows, {total_rows} were counted when the run started")
    table = pa.Table.from_batches(pieces)
    return [{c: table.slice(i, batch_size).column(c).to_numpy(zero_copy_only=False) for c in TRAINING_COLUMNS}
            for i in range(0, n, batch_size)]
