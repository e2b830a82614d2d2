"""An elastic run's data (pretrain.num_workers a range): every epoch in one order that no worker count changes, so
the position in it is a global count of sequences and a resize goes on at the next one, none lost, none twice.

The order: the epoch's shard files in an order drawn from (seed, phase, epoch), each file's rows in an order drawn
from the same and the file's place, cut into global batches (the phase's global_batch_size rows each; the rows
short of one at the epoch's end are left out, as drop_last leaves them). A global batch is sorted by length (fewer
padded slots, as length_binning.py does for a fixed count) and cut into micro-batches; micro-batch j of a global
batch goes to rank j // accumulation, so every rank trains `accumulation` micro-batches per optimizer step. Masks
and dropout are seeded by a micro-batch's place in the epoch, not by the rank: the same global batch is the same
training whatever the worker count, up to the order gradients are summed in.

Every worker reads every row of the epoch and keeps its share: a worker trains on its micro-batch far longer than
its rows take to read (BERT-Large at seq 128 on an H100 trains ~1,400 sequences a second, ~0.4 MB of token ids),
so reading the whole stream costs the world size times that, a few MB a second at 16 workers. A fixed worker count
reads through Ray Data's split instead (streams.py), bit for bit as before.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from bertpipe.jobs.pretrain.data.masking import seed_of
from bertpipe.pipeline.formats.shards import TRAINING_COLUMNS

# The rank slot of a shared-order seed: no worker's rank, so no fixed-count stream shares its seeds.
SHARED = 2**31 - 1


def file_order(files: list[str], seed: int, phase: int, epoch: int) -> list[str]:
    rng = np.random.default_rng(seed_of(seed, phase, epoch, SHARED))
    return [files[i] for i in rng.permutation(len(files))]


def read_shard_columns(uri: str) -> dict[str, np.ndarray]:
    """A shard's rows as numpy columns (a list column as an object array of arrays, as Ray Data hands it over)."""
    import pyarrow.parquet as pq

    from bertpipe.pipeline.framework import storage

    fs, path = storage.resolve(uri)
    table = pq.read_table(path, filesystem=fs, columns=list(TRAINING_COLUMNS))
    return {c: table.column(c).to_numpy(zero_copy_only=False) for c in TRAINING_COLUMNS}


def global_batches(files: list[str], seed: int, phase: int, epoch: int, global_batch: int, skip: int = 0,
                   read=read_shard_columns) -> Iterator[dict[str, np.ndarray]]:
    """The epoch's global batches in the shared order, after the first `skip` (not sorted: nothing trains them);
    `read(uri)`: a file's rows as columns."""
    pending: list[dict[str, np.ndarray]] = []
    held, index = 0, 0
    for place, uri in enumerate(file_order(files, seed, phase, epoch)):
        rows = read(uri)
        n = len(rows["input_ids"])
        order = np.random.default_rng(seed_of(seed, phase, epoch, SHARED, place)).permutation(n)
        pending.append({k: v[order] for k, v in rows.items()})
        held += n
        while held >= global_batch:
            batch, pending = _first_rows(pending, global_batch, copy=index >= skip)
            held -= global_batch
            if index >= skip:
                by_length = np.argsort([len(r) for r in batch["input_ids"]], kind="stable")
                yield {k: v[by_length] for k, v in batch.items()}
            index += 1


def _first_rows(chunks: list[dict[str, np.ndarray]], count: int,
                copy: bool = True) -> tuple[dict[str, np.ndarray] | None, list]:
    """The first `count` rows of `chunks` (columns each, oldest first), or None with `copy` False (a batch skipped
    on resume), and the chunks left. Only those rows are copied (the rest stay views): a shard of millions of rows
    is not copied again for each of its global batches."""
    taken, left = [], count
    while left:
        first, n = chunks[0], len(chunks[0]["input_ids"])
        if n <= left:
            taken.append(first)
            chunks, left = chunks[1:], left - n
        else:
            taken.append({k: v[:left] for k, v in first.items()})
            chunks, left = [{k: v[left:] for k, v in first.items()}, *chunks[1:]], 0
    return ({k: np.concatenate([t[k] for t in taken]) for k in taken[0]} if copy else None), chunks


def rank_micro_batches(batches: Iterator[dict[str, np.ndarray]], first: int, rank: int, world: int,
                       micro: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(place in the epoch, rows) of this rank's micro-batches of each global batch from `batches`, global batch
    number `first` on. The place numbers the epoch's micro-batches across all ranks: it seeds masks and dropout."""
    for k, batch in enumerate(batches, start=first):
        per_global = len(batch["input_ids"]) // micro
        accumulation = per_global // world
        for j in range(rank * accumulation, (rank + 1) * accumulation):
            yield k * per_global + j, {c: v[j * micro:(j + 1) * micro] for c, v in batch.items()}


def sequences_through(place: int, micro: int, global_batch: int) -> int:
    """The epoch's sequences trained by every rank once the global batch holding micro-batch `place` is done."""
    return (place // (global_batch // micro) + 1) * global_batch
