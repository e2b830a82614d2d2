"""Pass 2 of the pairs stage: equal-row Parquet shards from pass 1's part files, every task within
`pairs.max_task_bytes`.

Per length, the driver cuts the instances into cells (`plan_shards`): equal shares of every part, as many as it
takes for one to fit a task; a task reads its cells' slices, shuffles each cell and streams it into shards of
exactly the same row count, a row group at a time (fewer rows than cells or shards are dropped, and counted); one
task streams the held-out parts into one shard. Equal-row shards need every pool's count first, so the instances
are written twice: this is the only second pass.
"""
from __future__ import annotations

import os
import posixpath
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bertpipe.pipeline.formats.shards import SHARD_ROW_GROUP_ROWS
from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.stages.encoding import gather_ranges
from bertpipe.pipeline.stages.pair_pools import TASK_BASE_BYTES
from bertpipe.pipeline.stages.part_files import open_part, read_rows

# At least this many cells per length when the shards allow (a cell's work is spread over the cluster's cores);
# more cells mean more, smaller reads of every part file.
MIN_CELLS = 64
# A shard's row groups hold SHARD_ROW_GROUP_ROWS rows, fewer where they would be more than this many bytes of
# instances (seq 512: a writing task holds one row group, ~4x over).
ROW_GROUP_BYTES = 32 * 2**20
# Rows a cell task gathers at once into a row group.
TAKE_ROWS = 4_096
# The most bytes of instances one cell holds, whatever max_task_bytes allows. A bigger cell buys no better shuffle
# (every cell is already an equal share of every pool: a uniform sample of the corpus) and would only let a task's
# memory grow with the corpus until max_task_bytes stops it; a smaller one means more, smaller reads of every part
# file (a remote store reads whole record batches: PART_BATCH_BYTES).
CELL_BYTES = 192 * 2**20
# Besides its cell, a cell task holds one row group on its way out: gathered, encoded, compressed (~4x its bytes,
# measured), and the allocator's slack.
WRITE_SLACK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Cell:
    """A share of the training instances that one task holds at once: rows [first, end) of part files, shuffled
    together; its first `keep` rows fill `shards` ((shard index, rows), in order), the rest are dropped."""

    slices: tuple[tuple[int, int, int], ...]  # (part index, first row, end row)
    keep: int
    shards: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ShardPlan:
    rows_per_shard: int
    cells: tuple[Cell, ...]
    tasks: tuple[tuple[int, ...], ...]  # the cells each task writes, in order


def row_group_rows(bytes_per_row: float) -> int:
    return max(1, min(SHARD_ROW_GROUP_ROWS, int(ROW_GROUP_BYTES / max(bytes_per_row, 1.0))))


def cell_rows(max_task_bytes: int, bytes_per_row: float, local: bool) -> int:
    """The most instances one cell may hold: CELL_BYTES, fewer where its task would not stay within `max_task_bytes`.
    A cell is held once when its part files are local (mapped: their pages are the page cache's, not the task's),
    twice for a moment when they are read from a remote store (the record batches read, then their concatenation)."""
    row = max(bytes_per_row, 1.0)
    room = max_task_bytes - TASK_BASE_BYTES - WRITE_SLACK_BYTES - 4 * row_group_rows(row) * row
    return max(1, int(min(room / (1 if local else 2), CELL_BYTES) / row))


def plan_shards(counts: list[int], num_shards: int, max_cell_rows: int) -> ShardPlan:
    """Cells and tasks for `num_shards` equal-row shards of the instances of part files holding `counts` rows.

    The cells are C equal shares of every part (rows in random order already, so a contiguous slice is a random
    share): part p gives each cell counts[p] // C rows and its remainder goes one row each to the next cells in
    turn, continuing where the previous part's stopped, so every cell holds N // C or N // C + 1 rows. How many
    cells is set by data, not by the shard count alone: as few as fit `max_cell_rows` each, with
    - cells of whole shards when a shard fits a cell: C is the smallest divisor of num_shards that is at least
      the memory's need (and MIN_CELLS, where num_shards allows), one task a cell, N // num_shards rows a shard;
    - else J cells a shard, C = num_shards x J: the task of a shard writes its J cells one after the other, each
      N // C rows of it.
    Fewer than num_shards rows are dropped to make the shards equal."""
    total = int(sum(counts))
    if total < num_shards:
        return ShardPlan(0, (), ())
    per_shard = -(-total // num_shards)
    if per_shard <= max_cell_rows:
        need = max(-(-total // max_cell_rows), min(num_shards, MIN_CELLS))
        n_cells = min(d for d in range(need, num_shards + 1) if num_shards % d == 0)
        per_cell = num_shards // n_cells
        rows_per_shard = total // num_shards
        layout = [(per_cell * rows_per_shard, tuple((c * per_cell + k, rows_per_shard) for k in range(per_cell)))
                  for c in range(n_cells)]
        tasks = tuple((c,) for c in range(n_cells))
    else:
        per_shard_cells = -(-per_shard // max_cell_rows)
        n_cells = num_shards * per_shard_cells
        cell_keep = total // n_cells
        rows_per_shard = cell_keep * per_shard_cells
        layout = [(cell_keep, ((c // per_shard_cells, cell_keep),)) for c in range(n_cells)]
        tasks = tuple(tuple(range(k * per_shard_cells, (k + 1) * per_shard_cells)) for k in range(num_shards))
    counts_np = np.asarray(counts, np.int64)
    share = np.repeat((counts_np // n_cells)[:, None], n_cells, axis=1)
    turn = 0
    for p, extra in enumerate((counts_np % n_cells).tolist()):
        share[p, (turn + np.arange(extra)) % n_cells] += 1
        turn = (turn + extra) % n_cells
    first = np.cumsum(share, axis=1) - share
    cells = []
    for c, (keep, to_shards) in enumerate(layout):
        slices = tuple((p, int(first[p, c]), int(first[p, c] + share[p, c]))
                       for p in np.flatnonzero(share[:, c]).tolist())
        assert sum(e - f for _, f, e in slices) >= keep, f"cell {c} holds fewer than the {keep} rows it keeps"
        cells.append(Cell(slices, keep, to_shards))
    return ShardPlan(rows_per_shard, tuple(cells), tasks)



def _read_cell(parts: list[str], slices: tuple[tuple[int, int, int], ...], schema: pa.Schema) -> pa.Table:
    """A cell's rows from every part file, in one contiguous chunk per column."""
    batches = [b for p, first, end in slices for b in read_rows(parts[p], first, end)]
    if not batches:
        return schema.empty_table()
    return pa.Table.from_batches(batches).combine_chunks()


def _take(table: pa.Table, rows: np.ndarray, schema: pa.Schema) -> pa.Table:
    """table's `rows` (a single-chunk table), in the shard schema, gathered TAKE_ROWS at a time: input_ids by one
    vectorised copy of their token ranges (Arrow's take on a list column costs ~5x the column's size in memory),
    with index arrays of a few MB."""
    ids = table.column("input_ids").chunk(0)
    offsets, values = np.asarray(ids.offsets), np.asarray(ids.values)
    others = [(np.asarray(table.column(name).chunk(0)), schema.field(name).type) for name in schema.names[1:]]
    batches = []
    for lo in range(0, len(rows), TAKE_ROWS):
        some = rows[lo:lo + TAKE_ROWS]
        starts = offsets[some]
        lengths = offsets[some + 1] - starts
        new_offsets = np.zeros(len(some) + 1, np.int32)
        np.cumsum(lengths, out=new_offsets[1:])
        tokens = pa.array(gather_ranges(values, starts, lengths))
        columns = [pa.ListArray.from_arrays(pa.array(new_offsets), tokens, type=schema.field(0).type)]
        columns += [pa.array(column[some], kind) for column, kind in others]
        batches.append(pa.RecordBatch.from_arrays(columns, schema=schema))
    return pa.Table.from_batches(batches, schema=schema)


class _ShardWriter:
    """One shard written a row group at a time, under a temporary name until it is whole (shards.write_shard's
    compression: zstd)."""

    def __init__(self, uri: str, schema: pa.Schema):
        self.fs, self.path = storage.resolve(uri)
        parent = posixpath.dirname(self.path) if storage.is_remote(uri) else os.path.dirname(self.path)
        self.fs.create_dir(parent, recursive=True)
        self.tmp = storage.temp_path(self.path)
        self.stream = self.fs.open_output_stream(self.tmp)
        self.writer = pq.ParquetWriter(self.stream, schema, compression="zstd")
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        self.writer.write_table(table, row_group_size=table.num_rows or 1)  # one row group: its caller sized it
        self.rows += table.num_rows

    def close(self) -> int:
        self.writer.close()
        self.stream.close()
        self.fs.move(self.tmp, self.path)
        return self.rows


def write_cells(parts: list[str], cells: list[Cell], seeds: list[int], shard_uris: dict[int, str],
                schema_bytes: bytes, group_rows: int) -> dict:
    """Ray task: each cell read, shuffled (its seed) and streamed into its shards, a row group of `group_rows` at a
    time. Holds one cell. Returns {"rows": {shard: rows written}, "read_s", "shuffle_s", "write_s"}."""
    schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
    clocks = dict.fromkeys(("read_s", "shuffle_s", "write_s"), 0.0)
    written: dict[int, int] = {}
    writer: _ShardWriter | None = None
    shard = None
    for cell, seed in zip(cells, seeds):
        clock = time.process_time()
        table = _read_cell(parts, cell.slices, schema)
        order = np.random.default_rng(seed).permutation(table.num_rows)[: cell.keep]
        clocks["read_s"] += time.process_time() - clock
        done = 0
        for index, rows in cell.shards:
            if index != shard:
                if writer is not None:
                    written[shard] = writer.close()
                writer, shard = _ShardWriter(shard_uris[index], schema), index
            for lo in range(done, done + rows, group_rows):
                clock = time.process_time()
                piece = _take(table, order[lo: min(lo + group_rows, done + rows)], schema)
                middle = time.process_time()
                writer.write(piece)
                clocks["shuffle_s"] += middle - clock
                clocks["write_s"] += time.process_time() - middle
            done += rows
        del table
        # Arrow's allocator keeps freed memory for reuse; the next cell, or the next task in this worker, would
        # find the node's memory still held.
        pa.default_memory_pool().release_unused()
    if writer is not None:
        written[shard] = writer.close()
    return {"rows": written, **clocks}


def concat_parts(parts: list[str], uri: str, schema_bytes: bytes, group_rows: int) -> int:
    """Ray task: the held-out part files, in order, as one shard, streamed a part at a time."""
    schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
    writer = _ShardWriter(uri, schema)
    for part in parts:
        with open_part(part) as source:
            table = pa.ipc.open_file(source).read_all().cast(schema).replace_schema_metadata(schema.metadata)
        for lo in range(0, table.num_rows, group_rows):
            writer.write(table.slice(lo, group_rows))
    if not parts:
        writer.write(schema.empty_table())
    return writer.close()

