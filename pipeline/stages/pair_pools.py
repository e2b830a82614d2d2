"""Pass 1 of the pairs stage: one Ray task per pool of consecutive documents, reading its documents itself.

A pool is `docs_per_partition` consecutive documents (cut into several pools where their text would not fit a task,
`pairs.max_task_bytes`). Its task tokenizes it once, a slice of text at a time (encoding.py); holds out documents
by id hash; for every max_seq_length pairs the pool (NotNext B from another document of the same pool, as LDDL draws
from its partition), shuffles, and writes the instances as one part file (part_files.py), held-out instances as a
part of their own. Only a row of counters per pool comes back; instances never travel through the object store.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bertpipe.pipeline.formats import shards
from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.progress import Reporter
from bertpipe.pipeline.stages.documents import text_documents
from bertpipe.pipeline.stages.encoding import TOKENIZE_SLICE_CHARS, cached_tokenizers, encode_pool
from bertpipe.pipeline.stages.instances import PairStats, create_spans, gather_instances, token_pool
from bertpipe.pipeline.stages.part_files import part_batch_rows, write_part

def is_heldout(doc_id: int, fraction: float) -> bool:
    """Stable held-out membership from the document id alone (not the seed: the eval set must not move)."""
    h = int.from_bytes(hashlib.sha256(f"heldout:{doc_id}".encode()).digest()[:8], "little")
    return h < fraction * 2.0**64


def pair_table(flat: np.ndarray, bounds: list[list[int]], *, max_seq_length: int, short_seq_prob: float,
               dupe_factor: int, seed_parts: tuple, cls_id: int, sep_id: int,
               id_type: pa.DataType) -> tuple[pa.Table, PairStats]:
    """Instances (shard columns) of one pool of documents; documents without sentences are left out."""
    bounds = [b for b in bounds if len(b) > 1]
    spans, stats = create_spans(bounds, max_seq_length=max_seq_length, short_seq_prob=short_seq_prob,
                                dupe_factor=dupe_factor, seed_parts=seed_parts)
    table = gather_instances(flat, spans, cls_id, sep_id, id_type)
    stats.num_tokens = int(flat.size)
    return table, stats



COUNTERS = ("doc_passes", "short_targets", "no_other_document", "random_next", "instance_tokens")
# Where pass 1's time goes, CPU-seconds summed over its tasks: the profile the stage logs and records.
PASS1_CLOCKS = ("tokenize_s", "pair_s", "write_s")

# What a task holds besides its data: a Ray worker with pyarrow, numpy and the tokenizers loaded (~250 MB resident,
# measured), with room for the allocator's slack.
TASK_BASE_BYTES = 320 * 2**20
# Documents are tokenized in slices of about this much text: the word lists of `encode_documents` take ~25x the
# text, and WordPiece sees each distinct word once per slice (Zipf: at this size a slice is ~8% slower than the
# whole pool at once, 2 MB ~20%).
# Pass 1's memory per byte of a pool's text besides that slice (the text twice, as Arrow and as Python strings, its
# ids, the spans of every instance at every length, one record batch being gathered): ~6, measured at
# dupe_factor 10, seq 128 and 512 on Wikipedia articles; with room to spare.
POOL_BYTES_PER_TEXT_BYTE = 10


def pool_text_limit(max_task_bytes: int) -> int:
    """The most text one pairing pool may hold for its task to stay within `max_task_bytes`."""
    return max(1, (max_task_bytes - TASK_BASE_BYTES - 25 * TOKENIZE_SLICE_CHARS) // POOL_BYTES_PER_TEXT_BYTE)


def pools(text_bytes: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Consecutive (first, end) document ranges of at most `limit` bytes of text each (a longer document is a pool
    of its own): a batch of `docs_per_partition` documents is paired as one pool unless its text would not fit a
    task."""
    out, first, size = [], 0, 0
    for i, n in enumerate(text_bytes.tolist()):
        if i > first and size + n > limit:
            out.append((first, i))
            first, size = i, 0
        size += n
    if len(text_bytes):
        out.append((first, len(text_bytes)))
    return out



def _pair_length(pool, bounds, held, *, length, seed, key, dupe_factor, parts_uri, short_seq_prob,
                 id_type) -> dict:
    """Training and held-out instances of one pool at one length, written as part files; their counters."""
    clock = time.process_time()
    train_bounds = [b for b, h in zip(bounds, held) if not h and len(b) > 1]
    held_bounds = [b for b, h in zip(bounds, held) if h and len(b) > 1]
    spans, stats = create_spans(train_bounds, max_seq_length=length, short_seq_prob=short_seq_prob,
                                dupe_factor=dupe_factor, seed_parts=(seed, "pairs", length, key))
    held_spans, _ = create_spans(held_bounds, max_seq_length=length, short_seq_prob=short_seq_prob, dupe_factor=1,
                                 seed_parts=(seed + 1, "pairs", length, key))
    paired = time.process_time()
    # Written even when empty: pass 2 lists the training parts by the counters, and a part of 0 rows is read as none.
    batch_rows = part_batch_rows(length)
    folder = storage.join(parts_uri, shards.seq_dir(length))
    nbytes = write_part(storage.join(folder, f"train-{key}.arrow"), pool, spans, id_type, batch_rows)
    if len(held_spans):
        write_part(storage.join(folder, f"heldout-{key}.arrow"), pool, held_spans, id_type, batch_rows)
    instance_tokens = int((spans.a_hi - spans.a_lo).sum() + (spans.b_hi - spans.b_lo).sum()) + 3 * len(spans)
    return {f"rows_{length}": len(spans), f"bytes_{length}": nbytes, f"held_{length}": len(held_spans),
            "pair_s": paired - clock, "write_s": time.process_time() - paired,
            **{f"{name}_{length}": value for name, value in zip(COUNTERS, (
                stats.num_doc_passes, stats.num_short_targets, stats.num_no_other_document,
                int(spans.is_random.sum()), instance_tokens))}}


def pair_pool(ids: np.ndarray, texts: list[str], *, encoders, lowercase: bool, seeds: dict[int, int],
              heldout_fraction: float, dupe_factor: int, parts_uri: str, pair_kwargs: dict) -> dict:
    """Pass 1 on one pool: its part files at every length (`parts_uri`/seq{L}/train-{key}.arrow, heldout-...) and
    its row of counters and CPU-seconds."""
    clock = time.process_time()
    flat, bounds = encode_pool(texts, encoders, lowercase)
    held = [is_heldout(int(i), heldout_fraction) for i in ids]
    # The pool's identity comes from its content, not from the task that pairs it: its seeds and file names are the
    # same on every run and on a retry.
    key = hashlib.sha256(ids.tobytes()).hexdigest()[:16]
    row: dict = {"key": key, "documents": len(ids), "tokens": int(flat.size), "tokenize_s": time.process_time() - clock,
                 "pair_s": 0.0, "write_s": 0.0}
    pool = token_pool(flat, pair_kwargs["cls_id"], pair_kwargs["sep_id"], pair_kwargs["id_type"])
    for length, seed in seeds.items():
        counters = _pair_length(pool, bounds, held, length=length, seed=seed, key=key, dupe_factor=dupe_factor,
                                parts_uri=parts_uri, short_seq_prob=pair_kwargs["short_seq_prob"],
                                id_type=pair_kwargs["id_type"])
        row["pair_s"] += counters.pop("pair_s")
        row["write_s"] += counters.pop("write_s")
        row.update(counters)
    return row


def pair_batch(batch: pa.Table, *, vocab_uri: str, lowercase: bool, seeds: dict[int, int], heldout_fraction: float,
               dupe_factor: int, parts_uri: str, pair_kwargs: dict, pool_bytes: int) -> list[dict]:
    """Pass 1 on a batch of documents (id, text): one pool, or several where its text is more than `pool_bytes`;
    a row of counters per pool."""
    ids = np.asarray(batch.column("id").cast(pa.int64()).to_numpy(zero_copy_only=False))
    texts = batch.column("text")
    sizes = np.asarray(pc.fill_null(pc.binary_length(texts), 0).to_numpy(zero_copy_only=False), np.int64)
    encoders = cached_tokenizers(vocab_uri, lowercase)
    return [pair_pool(ids[a:b], texts.slice(a, b - a).to_pylist(), encoders=encoders, lowercase=lowercase,
                      seeds=seeds, heldout_fraction=heldout_fraction, dupe_factor=dupe_factor, parts_uri=parts_uri,
                      pair_kwargs=pair_kwargs)
            for a, b in pools(sizes, pool_bytes)]


@dataclass(frozen=True)
class DocRange:
    """Documents [first, end) of one input file; end -1: to its end (a text file: only reading it counts them)."""

    uri: str
    first: int
    end: int


def plan_pools(files: list[str], counts: list[int | None], docs_per_partition: int) -> list[tuple[DocRange, ...]]:
    """What each pass-1 task reads: the documents in file order, cut into pools of `docs_per_partition`
    consecutive documents across file boundaries; a text file (count None) is a task of its own, cut into pools as
    it is read."""
    out: list[tuple[DocRange, ...]] = []
    pool: list[DocRange] = []
    room = docs_per_partition
    for uri, count in zip(files, counts):
        if count is None:  # the pool before it ends here: a pool is consecutive documents
            out.extend([tuple(pool)] if pool else [])
            out.append((DocRange(uri, 0, -1),))
            pool, room = [], docs_per_partition
            continue
        first = 0
        while first < count:
            take = min(room, count - first)
            pool.append(DocRange(uri, first, first + take))
            first, room = first + take, room - take
            if room == 0:
                out.append(tuple(pool))
                pool, room = [], docs_per_partition
    if pool:
        out.append(tuple(pool))
    return out


def _read_range(r: DocRange) -> pa.Table:
    """(id int64, text string) of the documents of one range."""
    if r.end < 0:
        docs = text_documents(storage.read_bytes(r.uri), r.uri)
        return pa.table({"id": pa.array([d["id"] for d in docs], pa.int64()),
                         "text": pa.array([d["text"] for d in docs], pa.string())})
    fs, path = storage.resolve(r.uri)
    with fs.open_input_file(path) as f:
        parquet = pq.ParquetFile(f)
        sizes = [parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)]
        starts = np.cumsum([0, *sizes[:-1]])
        groups = [g for g, (start, size) in enumerate(zip(starts, sizes)) if start < r.end and start + size > r.first]
        table = parquet.read_row_groups(groups, columns=["id", "text"])
    return table.slice(r.first - int(starts[groups[0]]) if groups else 0, r.end - r.first)


def pair_docs(ranges: tuple[DocRange, ...], *, docs_per_partition: int, progress: Reporter | None = None,
              **batch_kwargs) -> list[dict]:
    """Ray task, pass 1 on one pool (or a text file's pools): the documents read here, by the task, not read ahead
    into the object store; their part files written; a row of counters per pool. Instances never travel through
    the object store."""
    table = pa.concat_tables([_read_range(r) for r in ranges])
    rows = [row for lo in range(0, table.num_rows, docs_per_partition)
            for row in pair_batch(table.slice(lo, docs_per_partition), **batch_kwargs)]
    pa.default_memory_pool().release_unused()  # see write_cells
    if progress is not None:
        progress.add(table.num_rows)
    return rows

